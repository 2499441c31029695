"""Judging every turn of real conversations: prompts per turn with their history, tau by turn and by context
length (stage eval on the real target, multi-turn ShareGPT conversations as the user's traffic file)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from data.sources import Skip, iter_json_array, normalise_messages, sharegpt_path
from eval.context import bucket_labels, bucket_of, check_buckets, grouped
from eval.heldout import Prompt
from eval.metrics import DecodeStats
from eval.report import Result
from tests.derived import assert_tau_derived
from tests.test_eval.test_stage_eval import _eval


def test_bucket_labels_and_edges() -> None:
    assert bucket_labels([512, 2048, 4096]) == ["<512", "512-2k", "2k-4k", "4k+"]
    assert [bucket_of(n, [512, 2048]) for n in (0, 511, 512, 2047, 2048, 10**6)] == [
        "<512", "<512", "512-2k", "512-2k", "2k+", "2k+"
    ]  # fmt: skip
    assert bucket_labels([100]) == ["<100", "100+"]
    check_buckets([1, 2, 3])
    for bad in ([512, 512], [2048, 512]):
        with pytest.raises(Exception, match="strictly increasing"):
            check_buckets(bad)


def _stats(lengths: list[int]) -> DecodeStats:
    return DecodeStats(accepted_lengths=lengths, new_tokens=sum(a + 1 for a in lengths))


def test_groups_pool_each_prompts_counters() -> None:
    """tau of a group is its prompts' emitted tokens over their steps; every prompt lands in exactly one bucket and
    one turn; prompts are matched by source:id, whatever their order."""
    prompts = [
        Prompt("a", "x", [0] * 100, 1),
        Prompt("a", "x#t2", [0] * 700, 2),
        Prompt("a", "y", [0] * 600, 1),
        Prompt("b", "z", [0] * 3000, 3),
    ]
    per = {"a": [_stats([0, 1]), _stats([3, 3, 3]), _stats([2])], "b": [_stats([0, 0, 4])]}
    res = Result("m", per_prompt={**per, "all": [*per["a"], *per["b"]]})
    res.prompt_ids = {"a": ["a:y", "a:x", "a:x#t2"], "b": ["b:z"]}
    res.prompt_ids["all"] = [*res.prompt_ids["a"], *res.prompt_ids["b"]]
    g = grouped(res, prompts, [512, 2048], n_boot=200, seed=0)
    # a:y (600 tokens, turn 1) emitted 1+2=3 in 2 steps; a:x (100, turn 1) 12 in 3; a:x#t2 (700, turn 2) 3 in 1
    assert g["a"]["by_context"]["<512"]["tau"] == pytest.approx(12 / 3)
    assert g["a"]["by_context"]["512-2k"]["tau"] == pytest.approx((3 + 3) / 3)
    assert g["a"]["by_turn"]["1"]["tau"] == pytest.approx((3 + 12) / 5)
    assert g["a"]["by_turn"]["2"]["prompts"] == 1 and g["a"]["by_context"]["512-2k"]["prompts"] == 2
    assert list(g["all"]["by_context"]) == ["<512", "512-2k", "2k+"] and list(g["all"]["by_turn"]) == ["1", "2", "3"]
    assert sum(x["prompts"] for x in g["all"]["by_context"].values()) == 4
    assert g["b"]["by_context"]["2k+"]["mean_context_tokens"] == 3000
    assert g["a"]["by_context"]["512-2k"]["per_prompt"]["ids"] == ["a:y", "a:x#t2"]


def _conversations(n: int, turns: int) -> list[dict]:
    """The first ``n`` ShareGPT conversations with at least ``turns`` user turns of short messages."""
    out = []
    for rec in iter_json_array(sharegpt_path()):
        if isinstance(rec, Skip) or not isinstance(rec, dict):
            continue
        try:
            msgs = normalise_messages(rec.get("conversations"), 400, turns)
        except Skip:
            continue
        if sum(m["role"] == "user" for m in msgs) == turns:
            out.append({"id": rec["id"], "source": "chat", "messages": msgs})
        if len(out) == n:
            return out
    raise AssertionError("not enough multi-turn conversations")


@pytest.mark.slow
def test_every_turn_is_judged_with_its_history(tmp_path: Path, run_env: dict[str, str], target) -> None:
    """eval.turns=all: one prompt per user turn (its earlier turns and answers as context), grouped by turn and by
    context length in metrics.json and table.md; the first turns judged alone (eval.turns=first) give the same
    counters as the turn-1 group, and eval.turns=last the same as the last-turn group."""
    from data.render import prompt_ids

    convs = _conversations(3, 3)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    lengths = {
        f"{c['id']}#t{t}" if t > 1 else c["id"]: len(prompt_ids(target.tokenizer, c["messages"][: 2 * t - 1]))
        for c in convs
        for t in (1, 2, 3)
    }
    ordered = sorted(lengths.values())
    edges = sorted({ordered[2], ordered[6]})  # three buckets (two if the lengths tie)
    args = [f"eval.prompts={tmp_path}/chat.jsonl", "eval.mode=replay", "eval.max_new_tokens=10"]
    args += ["eval.proposers=[prompt_lookup]", f"synth_dir={tmp_path / 'none'}", "wandb.mode=disabled"]
    args += [f"eval.context_buckets=[{','.join(map(str, edges))}]", "data.max_prompt_tokens=4096"]
    runs = {}
    for turns in ("all", "first", "last"):
        out = tmp_path / turns
        res = _eval([*args, f"eval.turns={turns}", f"hydra.run.dir={out}"], run_env)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs[turns] = json.loads((out / "metrics.json").read_text())["metrics"]["prompt_lookup_k5"]["chat"]
    table = (tmp_path / "all" / "table.md").read_text()
    assert "tau by context length" in table and "tau by turn" in table and "turn 3" in table

    m = runs["all"]
    assert m["prompts"] == 9 and sorted(m["per_prompt"]["ids"]) == sorted(f"chat:{k}" for k in lengths)
    assert {t: g["prompts"] for t, g in m["by_turn"].items()} == {"1": 3, "2": 3, "3": 3}
    want: dict[str, int] = {}
    for n in lengths.values():
        want[bucket_of(n, edges)] = want.get(bucket_of(n, edges), 0) + 1
    assert {b: g["prompts"] for b, g in m["by_context"].items()} == want
    for g in [*m["by_turn"].values(), *m["by_context"].values()]:
        assert_tau_derived(g)
    for turns, t in (("first", "1"), ("last", "3")):
        alone, group = runs[turns], m["by_turn"][t]
        assert alone["prompts"] == 3 and "by_turn" in alone and list(alone["by_turn"]) == [t]
        assert alone["per_prompt"] == group["per_prompt"] and alone["tau"] == pytest.approx(group["tau"])
    # later turns carry their history: each turn's prompt is longer than the one before
    for c in convs:
        assert lengths[c["id"]] < lengths[f"{c['id']}#t2"] < lengths[f"{c['id']}#t3"]
    assert list(itertools.chain(m["by_context"])) == [b for b in bucket_labels(edges) if b in want]
