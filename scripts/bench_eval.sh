#!/usr/bin/env bash
# Decoder benchmark on held-out real traffic (ShareGPT + HumanEval), greedy, default target, after the quickstart:
#  1. prompt lookup and a standalone draft (the target's first 6 layers, untrained) for K in {2, 4, 6};
#  2. tree vs chain at equal draft budget (K=5 chain vs a 5-node dynamic tree), trained EAGLE head and draft model;
#  3. our decoder vs HF assisted generation / HF prompt lookup with the same draft and K (tau and tokens/s).
# Each run measures plain target decoding on the same prompts in the same process (the speedup baseline).
# Usage: [RUNS_ROOT=runs] bash scripts/bench_eval.sh [run_name]   (<runs> is $RUNS_ROOT, default runs)
# Needs <runs>/<run_name>/synth and <runs>/<run_name>/train/best, made by
# `python3 -m train stage=all experiment=quickstart run_name=<run_name> runs_root=<runs>`; stops at once without them.
# Writes <runs>/<run_name>/bench/{k2,k4,k6,tree_vs_chain,hf}/.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-quickstart}
N=${N:-6}
TOK=${TOK:-48}
R=${RUNS_ROOT:-runs}
if [[ ! -f $R/$RUN/synth/manifest.json || ! -d $R/$RUN/train/best ]]; then
  echo "no quickstart run in $R/$RUN: make it with python3 -m train stage=all experiment=quickstart run_name=$RUN runs_root=$R" >&2
  exit 1
fi
common=(experiment=quickstart "run_name=$RUN" "eval.num_prompts=$N" "eval.max_new_tokens=$TOK" wandb.mode=disabled
        runs_root="$R")
for k in 2 4 6; do
  python3 -m train stage=eval "${common[@]}" "eval.k=$k" eval.decode=chain eval.draft_model=target_layers:6 \
    'eval.proposers=[prompt_lookup,draft_model]' "hydra.run.dir=$R/$RUN/bench/k$k"
done
python3 -m train stage=eval "${common[@]}" eval.k=5 eval.decode=both eval.tree_total_tokens=5 eval.tree_depth=5 \
  eval.tree_top_k=2 eval.draft_model=target_layers:6 'eval.proposers=[drafter,draft_model]' \
  "hydra.run.dir=$R/$RUN/bench/tree_vs_chain"
python3 -m train stage=eval "${common[@]}" eval.k=4 eval.decode=chain eval.draft_model=target_layers:6 \
  'eval.proposers=[draft_model,hf_assisted,prompt_lookup,hf_prompt_lookup]' "hydra.run.dir=$R/$RUN/bench/hf"
for d in "$R/$RUN"/bench/*/; do echo "## $d"; cat "$d/table.md"; done
