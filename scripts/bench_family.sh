#!/usr/bin/env bash
# One drafter family trained and judged on an experiment's synth data (made once by
# `python3 -m train stage=synth experiment=<exp> runs_root=<runs>`, or stage=all; the script stops at once,
# naming that command, when <runs>/<exp>/synth/manifest.json is missing). <runs> is $RUNS_ROOT, default runs:
#   [RUNS_ROOT=runs] bash scripts/bench_family.sh <eagle|eagle3|medusa|standalone|dflash> [quickstart|cpu_1h] [extra overrides...]
# Writes <runs>/<exp>_<family>/{features,train,eval}; the eval table has the chain (K=5) and the family's default
# tree, prompt lookup as the floor, plain decoding as the baseline, on the experiment's held-out prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILY=${1:?family}
EXP=${2:-quickstart}
shift $(( $# >= 2 ? 2 : 1 ))
R=${RUNS_ROOT:-runs}
[[ -f $R/$EXP/synth/manifest.json ]] || {
  echo "no synth data in $R/$EXP/synth: make it with python3 -m train stage=synth experiment=$EXP runs_root=$R" >&2
  exit 1
}
RUN=${EXP}_${FAMILY}
common=(experiment="$EXP" drafter="$FAMILY" "run_name=$RUN" "synth_dir=$R/$EXP/synth" wandb.mode=offline
        runs_root="$R" "$@")
# FEATURES_DIR=<runs>/<exp>/features reuses features already made for the same layers (eagle, medusa and
# standalone all read only the target's last layer); otherwise they are computed for this family.
if [[ -n "${FEATURES_DIR:-}" ]]; then
  common+=("train.features_dir=$FEATURES_DIR")
else
  python3 -m train stage=features "${common[@]}"
fi
python3 -m train stage=train "${common[@]}" overwrite=true
python3 -m train stage=eval "${common[@]}" eval.decode=both overwrite=true  # a rerun replaces the last table
du -sh "$R/$RUN/train/best"
cat "$R/$RUN/eval/table.md"
