#!/usr/bin/env bash
# The "mid-training" effect: the same EAGLE head and budget (the quickstart recipe) trained on
# target-regenerated answers (<runs>/quickstart, from stage=all experiment=quickstart) versus the original
# ShareGPT/HumanEval answers (synth.regenerate=false, same conversations), judged on the same held-out prompts.
#   [RUNS_ROOT=runs] bash scripts/bench_midtraining.sh     (<runs> is $RUNS_ROOT, default runs)
# Needs the regenerated run judged (<runs>/quickstart/synth and <runs>/quickstart/eval/table.md), made by
# `python3 -m train stage=all experiment=quickstart runs_root=<runs>`; stops at once without them.
# Writes <runs>/quickstart_orig/{synth,features,train,eval}.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${RUNS_ROOT:-runs}
if [[ ! -f $R/quickstart/synth/manifest.json || ! -f $R/quickstart/eval/table.md ]]; then
  echo "no judged quickstart run in $R/quickstart: make it with python3 -m train stage=all experiment=quickstart runs_root=$R" >&2
  exit 1
fi
ORIG=quickstart_orig
common=(experiment=quickstart "run_name=$ORIG" wandb.mode=disabled runs_root="$R")
python3 -m train stage=synth "${common[@]}" synth.regenerate=false
python3 -m train stage=features "${common[@]}"
python3 -m train stage=train "${common[@]}" overwrite=true
# Same held-out prompts as the regenerated run (the split is a hash of source and id; identical here).
python3 -m train stage=eval "${common[@]}" 'eval.proposers=[drafter]' "synth_dir=$R/quickstart/synth" overwrite=true
echo "## regenerated (target's own answers)"; cat "$R/quickstart/eval/table.md"
echo "## original answers"; cat "$R/$ORIG/eval/table.md"
