#!/usr/bin/env bash
# Training throughput with 1 and 2 processes (gloo on this CPU), DeepSpeed ZeRO-2, online target features,
# the same global batch (1 process x grad_accum 2 vs 2 processes x grad_accum 1), on the quickstart synth data.
set -euo pipefail
cd "$(dirname "$0")/.."
common=(experiment=quickstart run_name=quickstart stage=train train.features=online train.max_steps=20
        train.save_every=1000 train.eval_prompts=1 train.eval_max_new_tokens=4 wandb.mode=disabled overwrite=true)
python3 -m train "${common[@]}" train.grad_accum=2 hydra.run.dir=runs/quickstart/bench/train1
torchrun --nproc_per_node 2 -m train "${common[@]}" train.grad_accum=1 hydra.run.dir=runs/quickstart/bench/train2
for n in 1 2; do
  python3 -c "import json; r=json.load(open('runs/quickstart/bench/train$n/manifest.json'))['result']; \
print('processes', r['world_size'], 'tokens/s', r['train_tokens_per_second'], 'supervised tokens/s', r['supervised_tokens_per_second'])"
done
