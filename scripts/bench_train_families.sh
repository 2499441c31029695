#!/usr/bin/env bash
# Training throughput of the four drafter families, back to back on one quiet machine, same data and batch:
# the quickstart synth data (<runs>/quickstart/synth), precomputed target features (the last layer for eagle,
# medusa and standalone: <runs>/quickstart_eagle/features; layers 2/15/27/30 for eagle3: <runs>/quickstart/features,
# as the quickstart writes them), 8 rows per step, 1 process, no periodic checks. Whatever of those inputs is
# missing is made first (synth ~3 min, each feature set ~1 min on 2 cores). <runs> is $RUNS_ROOT, default runs.
#   [RUNS_ROOT=runs] bash scripts/bench_train_families.sh [steps=20] [extra overrides...]
# Prints sequence tokens/s and supervised (target-written) tokens/s per family from each run's manifest.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-20}
shift $(( $# >= 1 ? 1 : 0 ))
R=${RUNS_ROOT:-runs}
[[ -f $R/quickstart/synth/manifest.json ]] || python3 -m train stage=synth experiment=quickstart runs_root="$R"
[[ -f $R/quickstart/features/manifest.json ]] || python3 -m train stage=features experiment=quickstart runs_root="$R"
[[ -f $R/quickstart_eagle/features/manifest.json ]] || python3 -m train stage=features experiment=quickstart \
  drafter=eagle run_name=quickstart_eagle synth_dir="$R/quickstart/synth" runs_root="$R"
for fam in eagle eagle3 medusa standalone; do
  feats=$R/quickstart_eagle/features
  [[ $fam == eagle3 ]] && feats=$R/quickstart/features
  python3 -m train stage=train experiment=quickstart drafter=$fam run_name=tps_$fam synth_dir="$R/quickstart/synth" \
    train.features_dir=$feats train.max_steps="$STEPS" train.warmup_steps=2 train.save_every=100000 train.eval_every=0 \
    train.eval_prompts=1 train.eval_max_new_tokens=4 wandb.mode=disabled overwrite=true \
    runs_root="$R" hydra.run.dir="$R/tps/$fam" "$@"
done
echo "| family | steps | trainable params | train tok/s (sequence) | supervised tok/s |"
echo "|---|---|---|---|---|"
for fam in eagle eagle3 medusa standalone; do
  python3 -c "import json,sys; r=json.load(open('$R/tps/$fam/manifest.json'))['result']; \
print(f\"| $fam | {r['steps']} | {r['trainable_parameters']/1e6:.2f}M | {r['train_tokens_per_second']:.0f} | {r['supervised_tokens_per_second']:.0f} |\")"
done
