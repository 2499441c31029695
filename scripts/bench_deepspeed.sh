#!/usr/bin/env bash
# DeepSpeed engines against plain DDP on 2 CPU processes (gloo), side by side in one command: training tokens/s and
# each process's peak resident memory, for EAGLE-3 and the standalone draft (the family whose weights ZeRO-3 shards),
# on the quickstart synth data (<runs>/quickstart/synth, made first if absent, ~3 min on 2 cores), online target
# features, the same global batch and seed. <runs> is $RUNS_ROOT, default runs:
#   [RUNS_ROOT=runs] bash scripts/bench_deepspeed.sh [steps]         (default 10 steps per run, micro-batches of 4 rows up to 384 tokens; 6 runs, ~6 minutes on 2 cores)
# Writes <runs>/ds_bench/<family>_<engine>/ and prints one table (ratios against DDP of the same family).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-10}
R=${RUNS_ROOT:-runs}
synth="$R/quickstart/synth"
if [ ! -f "$synth/manifest.json" ]; then
  python3 -m train stage=synth experiment=quickstart runs_root="$R"
fi
common=(experiment=quickstart stage=train runs_root="$R" "synth_dir=$synth" train.features=online "train.max_steps=$steps"
        train.grad_accum=1 train.micro_batch_size=4 train.max_seq_len=384 train.ema_decay=0 train.save_every=100000 train.eval_prompts=1 train.eval_max_new_tokens=4
        "train.log_every=$steps" wandb.mode=disabled overwrite=true)
for family in eagle3 standalone; do
  for engine in none zero2 zero3; do
    torchrun --nproc_per_node 2 --master_port 29571 -m train "${common[@]}" "drafter=$family" "deepspeed=$engine" \
      "hydra.run.dir=$R/ds_bench/${family}_$engine"
  done
done
python3 - "$R/ds_bench" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
print(f"{'family':<11} {'engine':<62} {'tokens/s':>9} {'x DDP':>6} {'peak RSS MB per process':>24} {'final loss':>11}")
for family in ("eagle3", "standalone"):
    base = None
    for engine in ("none", "zero2", "zero3"):
        m = json.loads((root / f"{family}_{engine}" / "manifest.json").read_text())
        r = m["result"]
        tps = r["train_tokens_per_second"]
        base = base or tps
        rss = ", ".join(f"{v:.0f}" for v in r["peak_rss_mb_per_process"])
        print(f"{family:<11} {r['engine']:<62} {tps:>9.1f} {tps / base:>6.2f} {rss:>24} {m['losses'][-1][1]:>11.4f}")
EOF
