#!/usr/bin/env bash
# Training ablations, one change at a time: one family, one experiment's synth data, features computed once,
# every variant trained with the experiment's budget and judged by replay on the same held-out prompts.
#   bash scripts/bench_ablate.sh <family> <experiment> ["name:override override ..." ...]
# e.g. bash scripts/bench_ablate.sh eagle3 quickstart "frozen_head:drafter.freeze_lm_head=true" \
#        "decay1:drafter.ttt_decay=1.0" "clip1:train.max_grad_norm=1.0"
# A variant named "base" with no overrides always runs first. SYNTH_DIR (default runs/<experiment>/synth) picks the
# data. Prints a markdown table (tau with its 95% bootstrap interval over prompts, chain K=5 and the family's
# tree, per source and overall; training seconds) and writes it to runs/<experiment>_<family>_ablate/table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILY=${1:?family}
EXP=${2:?experiment}
shift 2
SYNTH=${SYNTH_DIR:-runs/$EXP/synth}
BASE=runs/${EXP}_${FAMILY}_ablate
common=(experiment="$EXP" drafter="$FAMILY" "synth_dir=$SYNTH" wandb.mode=offline)
python3 -m train stage=features "${common[@]}" "run_name=${EXP}_${FAMILY}_ablate"
runs=()
for spec in "base:" "$@"; do
  name=${spec%%:*}
  read -r -a ovr <<<"${spec#*:}"
  run=${EXP}_${FAMILY}_abl_${name}
  python3 -m train stage=train "${common[@]}" "run_name=$run" "train.features_dir=$BASE/features" overwrite=true "${ovr[@]}"
  python3 -m train stage=eval "${common[@]}" "run_name=$run" eval.mode=replay "eval.proposers=[drafter]" overwrite=true
  runs+=("runs/$run")
done
python3 - "$BASE/table.md" "${runs[@]}" <<'PY'
import json, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), sys.argv[2:]
lines = ["| variant | method | all | " + " | ".join(["sharegpt", "humaneval"]) + " | train s | trainable params |",
         "|---|---|---|---|---|---|---|"]
for r in runs:
    m = json.loads((Path(r) / "eval" / "metrics.json").read_text())["metrics"]
    t = json.loads((Path(r) / "train" / "manifest.json").read_text())["result"]
    for method in sorted(k for k in m if k != "plain"):
        cell = lambda s: (f"{m[method][s]['tau']:.3f} [{m[method][s]['tau_ci'][0]:.2f}, {m[method][s]['tau_ci'][1]:.2f}]"
                          if s in m[method] else "-")
        lines.append(f"| {Path(r).name.split('_abl_')[-1]} | {method} | {cell('all')} | {cell('sharegpt')} | "
                     f"{cell('humaneval')} | {t['seconds']:.0f} | {t['trainable_parameters']:,} |")
text = "\n".join(lines) + "\n"
out.write_text(text)
print(text)
PY
