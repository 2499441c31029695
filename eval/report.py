"""Stage eval's report: per-method figures from decoded and replayed samples, the cost model, tables and plot.

:func:`combine` merges a method's replayed acceptance (tau with its bootstrap interval, alpha_i, histogram, each
prompt's counters) with its decoded speed, cost ratios and lossless check (:func:`summarise`); :func:`predict`
and :func:`recommend_k` apply the speedup model; :func:`markdown_table` / :func:`temperature_table` /
:func:`plot` write what ``table.md`` and ``acceptance.png`` show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_with
from data.tables import cell, table
from eval.metrics import DecodeStats, expected_tokens_per_step
from eval.stats import bootstrap_tau_ci, describe_interval


@dataclass
class Result:
    """One method's decoding of every prompt."""

    name: str
    stats: dict[str, DecodeStats] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    k: int | None = None
    """Chain length (for the analytic model); None for trees and peers."""
    per_prompt: dict[str, list[DecodeStats]] = field(default_factory=dict)
    """Each prompt's own counters, by source (for the bootstrap interval)."""
    prompt_ids: dict[str, list[str]] = field(default_factory=dict)
    """The ids of ``per_prompt``'s prompts, same keys and order (for paired comparisons between runs)."""


def finish_result(res: Result, per: dict[str, list[DecodeStats]]) -> Result:
    """Pool per-prompt counters by source and over all sources ("all")."""
    res.per_prompt = {**per, "all": [x for v in per.values() for x in v]}
    res.stats = {s: DecodeStats.merge_all(v) for s, v in res.per_prompt.items()}
    keys = [k.split(":", 1) for k in res.outputs]  # "source:id", in the same prompt order as ``per``
    ids = {src: [i for s, i in keys if s == src] for src in per}
    if all(len(ids[src]) == len(v) for src, v in per.items()):
        res.prompt_ids = {src: [f"{src}:{i}" for i in v] for src, v in ids.items()}
        res.prompt_ids["all"] = [x for v in list(res.prompt_ids.values()) for x in v]
    return res


def summarise(res: Result, base: Result) -> dict[str, Any]:
    """Per-source figures of one method against the plain-decoding baseline of the same run.

    Cost model (Leviathan et al., 2023, with the verification cost measured rather than assumed equal to
    one decoding forward): a step costs one verification forward ``T_verify`` plus the drafting ``T_draft``;
    plain decoding costs ``T_plain`` per token. ``c = T_draft per draft token / T_plain`` and
    ``v = T_verify / T_plain``; predicted speedup = E[tokens per step] / (v + k c) for chains (E from the
    measured alpha_i) and tau / (v + T_draft / T_plain) for trees. HF peers do not split draft time (c = NaN).
    """
    out: dict[str, Any] = {}
    for src, s in res.stats.items():
        b = base.stats[src]
        tps = s.new_tokens / s.total_time_s if s.total_time_s > 0 else math.nan
        base_tps = b.new_tokens / b.total_time_s if b.total_time_s > 0 else math.nan
        steps = max(1, s.verify_steps)
        t_plain = b.target_time_s / max(1, b.target_forwards)
        t_verify = s.target_time_s / max(1, s.target_forwards)
        t_draft = s.draft_time_s / steps  # drafting for one step
        hf_peer = res.name.startswith("hf_")
        v = t_verify / t_plain if t_plain > 0 else math.nan
        c = math.nan if hf_peer else (t_draft / res.k if res.k else t_draft) / t_plain
        alpha = s.alpha()
        if hf_peer:
            predicted, model_tau = math.nan, s.tau()
        else:
            model_tau, predicted = predict(alpha, s.tau(), res.k, v, c)
        hist: dict[int, int] = {}
        for a in s.accepted_lengths:
            hist[a + 1] = hist.get(a + 1, 0) + 1
        same = [k for k in res.outputs if k.startswith(f"{src}:") or src == "all"]
        identical = sum(res.outputs[k] == base.outputs.get(k) for k in same) / max(1, len(same))
        out[src] = {
            "tau": s.tau(),
            "tau_hist": dict(sorted(hist.items())),
            "alpha": alpha,
            "draft_tokens_per_step": s.draft_tokens_proposed / steps,
            "target_forwards": s.target_forwards,
            "new_tokens": s.new_tokens,
            "tokens_per_s": tps,
            "speedup": tps / base_tps if base_tps and not math.isnan(base_tps) else math.nan,
            "draft_cost_ratio_c": c,
            "verify_cost_ratio_v": v,
            "model_tokens_per_step": model_tau,
            "predicted_speedup": predicted,
            "identical_to_plain": identical,
        }
    return out


def predict(alpha: list[float], tau: float, k: int | None, v: float, c: float) -> tuple[float, float]:
    """(expected tokens per step, predicted speedup) from the cost model of :func:`summarise`: a chain of ``k`` with
    every alpha_1..k measured uses E[tokens] from alpha over ``v + k c``; otherwise (trees, variable drafts) the
    measured tau over the measured cost of a step (``c`` is per draft token for chains, per step otherwise)."""
    if k and len(alpha) >= k and not any(math.isnan(a) for a in alpha[:k]):
        tokens = expected_tokens_per_step(alpha, k)
        return tokens, tokens / (v + k * c)
    return tau, tau / (v + (k * c if k else c))


def recommend_k(alpha: list[float], v: float, c: float) -> tuple[int, float]:
    """The chain length the built-in decoder would pick on this machine at batch 1: the K in 1..len(alpha) with the
    highest predicted speedup ``E_K / (v + K c)`` (the measured cost ratios of this eval), or (0, 1.0) (plain
    decoding) when none beats 1.0."""
    if not alpha or any(math.isnan(x) for x in (v, c)) or any(math.isnan(a) for a in alpha):
        return 0, math.nan
    preds = {k: expected_tokens_per_step(alpha, k) / (v + k * c) for k in range(1, len(alpha) + 1)}
    k = max(preds, key=lambda x: (preds[x], -x))
    return (k, preds[k]) if preds[k] > 1.0 else (0, 1.0)


_DECODE_ONLY = (
    "target_forwards",
    "new_tokens",
    "tokens_per_s",
    "speedup",
    "draft_cost_ratio_c",
    "verify_cost_ratio_v",
    "model_tokens_per_step",
    "predicted_speedup",
    "identical_to_plain",
)


GROUP_FIGURES = ("tau", "tau_ci", "alpha", "prompts", "new_tokens_judged", "per_prompt")
"""What :func:`acceptance` gives that a sub-table keeps (by temperature, by context length, by turn)."""


def acceptance(
    stats: DecodeStats, per_prompt: list[DecodeStats], n_boot: int, seed: int, ids: list[str] | None = None
) -> dict[str, Any]:
    """tau with its 95% bootstrap interval over prompts, alpha_i, the tau histogram, draft tokens per step, and
    each prompt's own counters (``per_prompt``: ids, tokens emitted, verification steps) for paired comparisons
    between runs judged on the same prompts (``eval.stats.paired_tau_diff``)."""
    hist: dict[int, int] = {}
    for a in stats.accepted_lengths:
        hist[a + 1] = hist.get(a + 1, 0) + 1
    lo, hi = bootstrap_tau_ci(per_prompt, n_boot=n_boot, seed=seed)
    return {
        "tau": stats.tau(),
        "tau_ci": [lo, hi],
        "tau_hist": dict(sorted(hist.items())),
        "alpha": stats.alpha(),
        "draft_tokens_per_step": stats.draft_tokens_proposed / max(1, stats.verify_steps),
        "prompts": len(per_prompt),
        "new_tokens_judged": stats.new_tokens,
        "per_prompt": {
            "ids": list(ids) if ids is not None and len(ids) == len(per_prompt) else None,
            "emitted": [sum(a + 1 for a in s.accepted_lengths) for s in per_prompt],
            "steps": [len(s.accepted_lengths) for s in per_prompt],
        },
    }


def combine(
    name: str,
    decoded: Result | None,
    base: Result | None,
    replayed: Result | None,
    k: int | None,
    e: Any,
) -> dict[str, Any]:
    """Per-source metrics of one method: acceptance (tau, interval, alpha, histogram) from the replayed sample
    when there is one, else from the decoded one; speed, cost ratios and the lossless check from decoding.

    ``tau_from`` says which sample gave tau; ``decode_tau`` is the decoded sample's own tau. With both, the
    predicted speedup uses the replayed alpha_i / tau with the decoded cost ratios c and v.
    """
    out: dict[str, Any] = {}
    dec = summarise(decoded, base) if decoded is not None and base is not None else {}
    sources = list(replayed.stats) if replayed is not None else list(dec)
    for src in sources:
        d = dec.get(src)
        if replayed is not None and src in replayed.stats:
            m = acceptance(
                replayed.stats[src], replayed.per_prompt[src], e.bootstrap, e.seed, replayed.prompt_ids.get(src)
            )
            m["tau_from"] = "replay"
            m["replay_draft_seconds"] = replayed.stats[src].draft_time_s
        elif decoded is not None:
            m = acceptance(
                decoded.stats[src], decoded.per_prompt[src], e.bootstrap, e.seed, decoded.prompt_ids.get(src)
            )
            m["tau_from"] = "decode"
        else:
            continue
        if d is None:
            m.update({key: math.nan for key in _DECODE_ONLY})
            m["decode_tau"] = math.nan
        else:
            m.update({key: d[key] for key in _DECODE_ONLY})
            m["decode_tau"] = d["tau"]
            m["decode_prompts"] = len(decoded.per_prompt.get(src, [])) if decoded is not None else 0
            if m["tau_from"] == "replay" and not name.startswith("hf_") and name != "plain":
                m["model_tokens_per_step"], m["predicted_speedup"] = predict(
                    m["alpha"], m["tau"], k, d["verify_cost_ratio_v"], d["draft_cost_ratio_c"]
                )
            if k and name != "plain" and not name.startswith("hf_"):
                m["recommended_k"], m["recommended_predicted_speedup"] = recommend_k(
                    m["alpha"], d["verify_cost_ratio_v"], d["draft_cost_ratio_c"]
                )
        out[src] = m
    return out


EVAL_HEADER = [
    "source", "method", "tau [95% CI]", "prompts", "alpha_1..3", "draft tok/step", "decode tau", "tok/s", "speedup",
    "c", "v", "predicted", "identical",
]  # fmt: skip


def _eval_row(src: str, name: str, m: dict[str, Any]) -> list[str]:
    al = ", ".join(cell(a, ".2f") for a in m["alpha"][:3]) if m["alpha"] else "-"
    lo, hi = m.get("tau_ci", [math.nan, math.nan])
    expected = f" (expected {cell(m['expected_tau'], '.2f')})" if "expected_tau" in m else ""
    return [
        src,
        name,
        f"{m['tau']:.2f} {describe_interval(lo, hi)}",
        f"{m.get('prompts', '-')} {m.get('tau_from', '')}".strip(),
        al,
        f"{m['draft_tokens_per_step']:.1f}",
        cell(m.get("decode_tau", math.nan), ".2f") + expected,
        cell(m["tokens_per_s"], ".1f"),
        cell(m["speedup"], ".2f", "x"),
        cell(m["draft_cost_ratio_c"], ".3f"),
        cell(m["verify_cost_ratio_v"], ".2f"),
        cell(m["predicted_speedup"], ".2f", "x"),
        cell(m["identical_to_plain"], ".0%"),
    ]


def markdown_table(metrics: dict[str, dict[str, Any]], sources: list[str]) -> str:
    rows = [_eval_row(src, name, per[src]) for src in sources for name, per in metrics.items() if src in per]
    lines = table(EVAL_HEADER, rows)
    for name, per in metrics.items():
        m = per.get("all") or {}
        if m.get("recommended_k") is not None and not math.isnan(m.get("recommended_predicted_speedup", math.nan)):
            k = m["recommended_k"]
            lines.append(
                f"\n{name}: on this machine at batch 1 the built-in decoder would draft K={k} "
                f"(predicted {m['recommended_predicted_speedup']:.2f}x from alpha, c and v)"
                if k
                else f"\n{name}: on this machine at batch 1 no K is predicted to beat plain decoding"
            )
    return "\n".join(lines)


def temperature_table(metrics: dict[str, dict[str, Any]], sources: list[str], temps: list[float]) -> str:
    """tau [95% interval] per method and source at each replayed temperature (``eval.temperatures``)."""
    cols = [f"{t:g}" for t in temps]
    rows = []
    for src in sources:
        for name, per in metrics.items():
            bt = (per.get(src) or {}).get("by_temperature")
            if bt:
                cells = [f"{bt[c]['tau']:.2f} {describe_interval(*bt[c]['tau_ci'])}" if c in bt else "-" for c in cols]
                rows.append([src, name, *cells])
    lines = table(["source", "method", *(f"T={c}" for c in cols)], rows)
    return "\n".join(["tau by temperature (replay; sampled paths at T > 0):\n", *lines])


def plot(metrics: dict[str, dict[str, Any]], path: Path, buckets: list[str] | None = None) -> None:
    """Per-position acceptance and the acceptance-length histogram of each method (all sources); with ``buckets``
    (the context-length labels of ``eval.context_buckets``) a third panel: tau with its interval by context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if buckets else 2, figsize=(16 if buckets else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    if buckets:
        ax3 = axes[2]
        for name, per in metrics.items():
            by = per["all"].get("by_context") or {}
            xs = [i for i, b in enumerate(buckets) if b in by]
            if name == "plain" or not xs:
                continue
            taus = [by[buckets[i]]["tau"] for i in xs]
            lo = [t - by[buckets[i]]["tau_ci"][0] for t, i in zip(taus, xs, strict=True)]
            hi = [by[buckets[i]]["tau_ci"][1] - t for t, i in zip(taus, xs, strict=True)]
            ax3.errorbar(xs, taus, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax3.set_xticks(range(len(buckets)), buckets)
        ax3.set(xlabel="context (prompt tokens)", ylabel="tau", title="acceptance by context length")
        ax3.grid(alpha=0.3)
        if ax3.get_legend_handles_labels()[0]:
            ax3.legend(fontsize=7)
    for name, per in metrics.items():
        m = per["all"]
        if name == "plain" or not m["alpha"]:
            continue
        ax1.plot(range(1, len(m["alpha"]) + 1), m["alpha"], marker="o", label=name)
        total = sum(m["tau_hist"].values())
        xs = sorted(m["tau_hist"])
        label = f"{name} (tau {m['tau']:.2f} {describe_interval(*m['tau_ci'])})"
        ax2.plot(xs, [m["tau_hist"][x] / total for x in xs], marker=".", label=label)
    ax1.set(xlabel="draft position i", ylabel="alpha_i", title="per-position acceptance", ylim=(0, 1.02))
    ax2.set(xlabel="tokens per target forward", ylabel="fraction of steps", title="acceptance length")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
