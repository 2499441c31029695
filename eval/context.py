"""Acceptance by conversation turn and by context length.

Acceptance falls as the context grows (a drafter sees little long context in training; its features drift), so
one pooled tau hides what a user's long or late-turn traffic gets. Each judged prompt knows its turn and its
length in tokens (earlier turns and their answers included); a method's per-prompt counters are grouped by
either, and each group gets tau with its bootstrap interval over the group's prompts (the same estimator as the
main table). The turns of one conversation are counted as separate prompts.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from data.config import ConfigError
from data.tables import table
from eval.heldout import Prompt
from eval.metrics import DecodeStats
from eval.report import GROUP_FIGURES, Result, acceptance
from eval.stats import describe_interval


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def bucket_labels(edges: list[int]) -> list[str]:
    """``[512, 2048, 4096]`` -> ``["<512", "512-2k", "2k-4k", "4k+"]``."""
    if not edges:
        return ["all"]
    inner = [f"{_tokens(a)}-{_tokens(b)}" for a, b in pairwise(edges)]
    return [f"<{_tokens(edges[0])}", *inner, f"{_tokens(edges[-1])}+"]


def bucket_of(length: int, edges: list[int]) -> str:
    labels = bucket_labels(edges)
    return labels[sum(length >= e for e in edges)]


def check_buckets(edges: list[int]) -> None:
    if any(b <= a for a, b in pairwise(edges)):
        raise ConfigError(f"eval.context_buckets={edges} must be strictly increasing (prompt lengths in tokens)")


def grouped(
    res: Result, prompts: list[Prompt], edges: list[int], n_boot: int, seed: int
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per source (and "all"): ``{"by_context": {bucket: figures}, "by_turn": {turn: figures}}``, the figures of
    :func:`eval.report.acceptance` (tau, interval, alpha, prompts, each prompt's counters) plus the group's mean
    context length. Prompts are matched to their counters by ``source:id``."""
    known = {f"{p.source}:{p.id}": p for p in prompts}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for src, stats in res.per_prompt.items():
        ids = res.prompt_ids.get(src)
        if not ids or len(ids) != len(stats) or any(i not in known for i in ids):
            continue
        groups: dict[str, dict[str, list[tuple[str, DecodeStats]]]] = {"by_context": {}, "by_turn": {}}
        for key, s in zip(ids, stats, strict=True):
            p = known[key]
            groups["by_context"].setdefault(bucket_of(len(p.input_ids), edges), []).append((key, s))
            groups["by_turn"].setdefault(str(p.turn), []).append((key, s))
        order = {"by_context": bucket_labels(edges), "by_turn": sorted(groups["by_turn"], key=int)}
        out[src] = {}
        for kind, by in groups.items():
            out[src][kind] = {}
            for label in order[kind]:
                if label not in by:
                    continue
                keys, group = [k for k, _ in by[label]], [s for _, s in by[label]]
                a = acceptance(DecodeStats.merge_all(group), group, n_boot, seed, keys)
                figures = {k: a[k] for k in GROUP_FIGURES}
                figures["mean_context_tokens"] = round(sum(len(known[k].input_ids) for k in keys) / len(keys), 1)
                out[src][kind][label] = figures
    return out


def _cell(g: dict[str, Any]) -> str:
    return f"{g['tau']:.2f} {describe_interval(*g['tau_ci'])} ({g['prompts']})"


def context_table(metrics: dict[str, dict[str, Any]], sources: list[str], edges: list[int]) -> str:
    """tau [95% interval] (prompts) per method and source in each context bucket, then per turn when more than
    the first is judged."""

    def rows(kind: str, cols: list[str]) -> list[list[str]]:
        out = []
        for src in sources:
            for name, per in metrics.items():
                by = (per.get(src) or {}).get(kind)
                if by:
                    cells = [_cell(by[c]) if c in by else "-" for c in cols]
                    out.append([src, name, *cells])
        return out

    labels = bucket_labels(edges)
    lines = ["tau by context length (prompt tokens, earlier turns included; prompts in brackets):\n"]
    lines += table(["source", "method", *labels], rows("by_context", labels))
    turns = sorted({t for per in metrics.values() for m in per.values() for t in (m.get("by_turn") or {})}, key=int)
    if len(turns) > 1:
        lines += ["", "tau by turn (the user turn a prompt ends with):\n"]
        lines += table(["source", "method", *(f"turn {t}" for t in turns)], rows("by_turn", turns))
    return "\n".join(lines)


def flat(metrics: dict[str, dict[str, Any]]) -> dict[str, float]:
    """W&B scalars: ``<method>/<source>/tau@ctx<bucket>`` and ``tau@turn<t>`` with their ``tau_lo`` / ``tau_hi``."""
    out: dict[str, float] = {}
    for name, per in metrics.items():
        for src, m in per.items():
            for kind, tag in (("by_context", "ctx"), ("by_turn", "turn")):
                for label, g in (m.get(kind) or {}).items():
                    out[f"{name}/{src}/tau@{tag}{label}"] = g["tau"]
                    out[f"{name}/{src}/tau_lo@{tag}{label}"], out[f"{name}/{src}/tau_hi@{tag}{label}"] = g["tau_ci"]
    return out
