#!/usr/bin/env bash
# Training ablations, one change at a time: one family, one experiment's synth data, features computed once,
# every variant trained with the experiment's budget and judged by replay on the same held-out prompts.
#   [RUNS_ROOT=runs] bash scripts/bench_ablate.sh <family> <experiment> ["name:override override ..." ...]
# e.g. bash scripts/bench_ablate.sh eagle3 quickstart "frozen_head:drafter.freeze_lm_head=true" \
#        "decay1:drafter.ttt_decay=1.0" "clip1:train.max_grad_norm=1.0"
# <runs> is $RUNS_ROOT (default runs): every run is written under it and every stage gets runs_root=<runs>.
# Needs the experiment's synth data: the script stops at once, naming the command, when <synth>/manifest.json is
# missing (make it with `python3 -m train stage=synth experiment=<experiment> runs_root=<runs>`).
# A variant named "base" with no overrides always runs first. SYNTH_DIR (default <runs>/<experiment>/synth) picks the
# data; REUSE_BASE=1 keeps an existing base run (its train and eval already done with the same base overrides).
# BASE_NAME (default base) names the baseline variant, so a new series of ablations does not overwrite an older base.
# FEATURES_DIR (default: computed into <runs>/<experiment>_<family>_ablate/features) reuses a feature store, e.g. one made
# with more target layers (stage=features drafter.layer_ids=[...]) so that variants may fuse different layers.
# BASE_OVERRIDES (space-separated) are applied to every variant, base included; EVAL_OVERRIDES to every eval, e.g.
# EVAL_OVERRIDES="eval.temperatures=[0,1.0] eval.samples=2" judges each variant at T=0 and T=1 (rows method@T1). Prints a markdown table (tau with its 95% bootstrap interval over prompts, chain K=5 and the family's
# tree, per source and overall; the paired difference to base over the same prompts; training seconds) and writes it to <runs>/<experiment>_<family>_ablate/table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILY=${1:?family}
EXP=${2:?experiment}
shift 2
R=${RUNS_ROOT:-runs}
SYNTH=${SYNTH_DIR:-$R/$EXP/synth}
[[ -f $SYNTH/manifest.json ]] || {
  echo "no synth data in $SYNTH: make it with python3 -m train stage=synth experiment=$EXP runs_root=$R" >&2; exit 1; }
BASE=$R/${EXP}_${FAMILY}_ablate
common=(experiment="$EXP" drafter="$FAMILY" "synth_dir=$SYNTH" wandb.mode=offline runs_root="$R")
FEATS=${FEATURES_DIR:-$BASE/features}
if [[ -z ${FEATURES_DIR:-} ]]; then
  python3 -m train stage=features "${common[@]}" "run_name=${EXP}_${FAMILY}_ablate"
fi
runs=()
read -r -a base_ovr <<<"${BASE_OVERRIDES:-}"
BASE_NAME=${BASE_NAME:-base}
for spec in "$BASE_NAME:" "$@"; do
  name=${spec%%:*}
  read -r -a ovr <<<"${spec#*:}"
  ovr=("${base_ovr[@]}" "${ovr[@]}")
  run=${EXP}_${FAMILY}_abl_${name}
  if [[ $name == "$BASE_NAME" && ${REUSE_BASE:-0} == 1 && -f $R/$run/eval/metrics.json ]]; then
    runs+=("$R/$run")
    continue
  fi
  python3 -m train stage=train "${common[@]}" "run_name=$run" "train.features_dir=$FEATS" overwrite=true "${ovr[@]}"
  read -r -a eval_ovr <<<"${EVAL_OVERRIDES:-}"
  python3 -m train stage=eval "${common[@]}" "run_name=$run" eval.mode=replay "eval.proposers=[drafter]" overwrite=true \
    "${eval_ovr[@]}"
  runs+=("$R/$run")
done
mkdir -p "$BASE"  # with FEATURES_DIR set nothing else made it
python3 - "$BASE/table.md" "${runs[@]}" <<'PY'
import json, sys
from pathlib import Path
from eval.stats import describe_paired, paired_tau_diff
out, runs = Path(sys.argv[1]), sys.argv[2:]


def views(metrics):
    """(label, {source: record}) per method, and per method and temperature of eval.temperatures (method@T1)."""
    for method in sorted(k for k in metrics if k != "plain"):
        yield method, metrics[method]
        temps = sorted({t for rec in metrics[method].values() for t in rec.get("by_temperature", {})}, key=float)
        for t in temps:
            if float(t) > 0:
                yield f"{method}@T{t}", {s: rec["by_temperature"][t] for s, rec in metrics[method].items()}


lines = ["| variant | method | tau all [95% CI] | sharegpt | humaneval | paired vs base (all) | train s | trainable params |",
         "|---|---|---|---|---|---|---|---|"]
base = dict(views(json.loads((Path(runs[0]) / "eval" / "metrics.json").read_text())["metrics"]))
for r in runs:
    t = json.loads((Path(r) / "train" / "manifest.json").read_text())["result"]
    for method, per in views(json.loads((Path(r) / "eval" / "metrics.json").read_text())["metrics"]):
        def cell(s):
            if s not in per:
                return "-"
            x = per[s]
            return f"{x['tau']:.3f} [{x['tau_ci'][0]:.2f}, {x['tau_ci'][1]:.2f}]"
        paired = "baseline" if r == runs[0] else describe_paired(
            paired_tau_diff(base.get(method, {}).get("all", {}).get("per_prompt") or {}, per["all"].get("per_prompt") or {}))
        lines.append(f"| {Path(r).name.split('_abl_')[-1]} | {method} | {cell('all')} | {cell('sharegpt')} | "
                     f"{cell('humaneval')} | {paired} | {t['seconds']:.0f} | {t['trainable_parameters']:,} |")
text = "\n".join(lines) + "\n"
out.write_text(text)
print(text)
PY
