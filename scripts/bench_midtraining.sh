#!/usr/bin/env bash
# The "mid-training" effect: the same EAGLE head and budget (the quickstart recipe) trained on
# target-regenerated answers (runs/quickstart, from stage=all experiment=quickstart) versus the original
# ShareGPT/HumanEval answers (synth.regenerate=false, same conversations), judged on the same held-out prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
ORIG=quickstart_orig
common=(experiment=quickstart "run_name=$ORIG" wandb.mode=disabled)
python3 -m train stage=synth "${common[@]}" synth.regenerate=false
python3 -m train stage=features "${common[@]}"
python3 -m train stage=train "${common[@]}" overwrite=true
# Same held-out prompts as the regenerated run (the split is a hash of source and id; identical here).
python3 -m train stage=eval "${common[@]}" 'eval.proposers=[drafter]' synth_dir=runs/quickstart/synth overwrite=true
echo "## regenerated (target's own answers)"; cat runs/quickstart/eval/table.md
echo "## original answers"; cat runs/$ORIG/eval/table.md
