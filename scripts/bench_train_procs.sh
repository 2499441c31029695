#!/usr/bin/env bash
# Training throughput with 1 and 2 processes (gloo on this CPU), DeepSpeed ZeRO-2, online target features,
# the same global batch (1 process x grad_accum 2 vs 2 processes x grad_accum 1), on the quickstart synth data
# (<runs>/quickstart/synth; made first when missing, ~3 min on 2 cores). <runs> is $RUNS_ROOT, default runs:
#   [RUNS_ROOT=runs] bash scripts/bench_train_procs.sh
# Writes <runs>/quickstart/bench/train{1,2}/.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${RUNS_ROOT:-runs}
[[ -f $R/quickstart/synth/manifest.json ]] || python3 -m train stage=synth experiment=quickstart runs_root="$R"
common=(experiment=quickstart run_name=quickstart stage=train train.features=online train.max_steps=20
        train.save_every=1000 train.eval_prompts=1 train.eval_max_new_tokens=4 wandb.mode=disabled overwrite=true
        runs_root="$R")
python3 -m train "${common[@]}" train.grad_accum=2 "hydra.run.dir=$R/quickstart/bench/train1"
torchrun --nproc_per_node 2 -m train "${common[@]}" train.grad_accum=1 "hydra.run.dir=$R/quickstart/bench/train2"
for n in 1 2; do
  python3 -c "import json; r=json.load(open('$R/quickstart/bench/train$n/manifest.json'))['result']; \
print('processes', r['world_size'], 'tokens/s', r['train_tokens_per_second'], 'supervised tokens/s', r['supervised_tokens_per_second'])"
done
