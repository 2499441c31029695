#!/usr/bin/env bash
# DFlash against EAGLE-3 on an experiment's synth data, at its training budget (same rows, same steps):
#   [RUNS_ROOT=runs] bash scripts/bench_dflash.sh [quickstart|cpu_1h] [block sizes, default 4 8 16]
# Trains the experiment's EAGLE-3 head and one DFlash draft per block size on the same precomputed features (both
# read target layers 2, N/2, N-3), judges each with stage eval on the experiment's held-out prompts (replayed tau
# with its 95% interval; decoded wall clock against plain decoding, the measured c and v and the speedup they
# predict), EAGLE-3 as a K=5 chain and its tree, DFlash as the chain of its whole block (K = block_size - 1), then
# puts them side by side with stage compare (paired tau differences over the same prompts):
#   <runs>/<exp>_cmp_dflash/compare/compare.md
# Needs the experiment's synth data (python3 -m train stage=synth experiment=<exp> runs_root=<runs>); stops at once,
# naming that command, without it. FEATURES_DIR reuses a feature store of the same layers (e.g. <runs>/quickstart/features).
set -euo pipefail
cd "$(dirname "$0")/.."
EXP=${1:-quickstart}
shift $(( $# >= 1 ? 1 : 0 ))
BLOCKS=("$@")
[[ ${#BLOCKS[@]} -gt 0 ]] || BLOCKS=(4 8 16)
R=${RUNS_ROOT:-runs}
SYNTH=${SYNTH_DIR:-$R/$EXP/synth}
[[ -f $SYNTH/manifest.json ]] || {
  echo "no synth data in $SYNTH: make it with python3 -m train stage=synth experiment=$EXP runs_root=$R" >&2; exit 1; }
OUT=${EXP}_cmp_dflash
common=(experiment="$EXP" "synth_dir=$SYNTH" wandb.mode=offline runs_root="$R")
FEATS=${FEATURES_DIR:-$R/$OUT/features}
if [[ -z ${FEATURES_DIR:-} ]]; then
  python3 -m train stage=features "${common[@]}" drafter=eagle3 "run_name=$OUT"
fi
runs=()
one() {  # run_name drafter eval-overrides... -- train-overrides...
  local run=$1 drafter=$2; shift 2
  local ev=() tr=()
  while [[ $# -gt 0 && $1 != -- ]]; do ev+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  tr=("$@")
  python3 -m train stage=train "${common[@]}" drafter="$drafter" "run_name=$run" "train.features_dir=$FEATS" \
    overwrite=true "${tr[@]}"
  python3 -m train stage=eval "${common[@]}" drafter="$drafter" "run_name=$run" overwrite=true "${ev[@]}"
  runs+=("$R/$run")
}
one "${EXP}_cmp_eagle3" eagle3 eval.decode=both eval.k=5
for b in "${BLOCKS[@]}"; do
  one "${EXP}_cmp_dflash_b$b" dflash eval.decode=chain "eval.k=$((b - 1))" -- "drafter.block_size=$b"
done
list=$(IFS=,; echo "${runs[*]}")
python3 -m train stage=compare "runs=[$list]" "run_name=$OUT" runs_root="$R"
cat "$R/$OUT/compare/compare.md"
