"""The shipped probe of kinds of traffic the embedded default never trains on (``eval/probes/unseen_kinds.jsonl``):
every row is a usable prompt for ``eval.prompts=``, grouped by kind."""

from __future__ import annotations

from pathlib import Path

from eval.heldout import traffic_prompts

PROBE = Path(__file__).resolve().parents[2] / "eval" / "probes" / "unseen_kinds.jsonl"


def test_unseen_kinds_probe_loads_as_eight_kinds_of_five(target) -> None:
    prompts, skipped = traffic_prompts(str(PROBE), target.tokenizer, per_source=24, max_prompt_tokens=384)
    assert skipped == {}
    kinds: dict[str, int] = {}
    for p in prompts:
        kinds[p.source] = kinds.get(p.source, 0) + 1
        assert len(p.input_ids) > 10
    assert kinds == dict.fromkeys(["math", "json", "translation", "sql_shell", "story", "email", "facts", "advice"], 5)
    assert len({p.id for p in prompts}) == 40


LONG = PROBE.parent / "long_context.jsonl"


def test_long_context_probe_is_the_stdlib_head_of_each_file_within_its_budget(target) -> None:
    """``eval/probes/long_context.jsonl`` (scripts/build_long_probe.py): 24 prompts of 1k-6k tokens whose code is
    the first lines of a real file of this interpreter's standard library, cut where the next line would pass the
    budget; every prompt loads for eval.prompts within the target's window."""
    import json
    import platform
    import sysconfig

    from data.render import prompt_ids
    from scripts.build_long_probe import ASK, build, head_within

    prompts, skipped = traffic_prompts(str(LONG), target.tokenizer, 100, max_prompt_tokens=8192, max_chars=40000)
    assert skipped == {} and len(prompts) == 24 and {p.source for p in prompts} == {"long_code"}
    lengths = sorted(len(p.input_ids) for p in prompts)
    assert lengths[0] >= 0.9 * 1024 and lengths[-1] <= 6144 and lengths[12] > 2048  # spread over the range
    root = Path(sysconfig.get_paths()["stdlib"])
    shipped = [json.loads(line) for line in LONG.read_text(encoding="utf-8").splitlines()]
    # another interpreter has other stdlib files: then the builder's own output is what is checked against them
    same = {r["python"] for r in shipped} == {platform.python_version()}
    rows = shipped if same else build(target.tokenizer, 24, 1024, 6144)
    for row in rows:
        rel, span = row["id"].rsplit(":", 1)
        n = int(span.split("-")[1])
        lines = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        assert row["messages"][0]["content"] == ASK + "".join(lines[:n])  # real text, not written here
        assert n < len(lines)  # something is left to continue
        assert len(prompt_ids(target.tokenizer, row["messages"])) <= 6144
    # the builder: the longest head within a budget, and the same probe again from the same interpreter
    assert head_within(["a" * 10] * 5, 25, len) == 2 and head_within(["a"] * 3, 100, len) == 3
    if same:
        assert build(target.tokenizer, 24, 1024, 6144) == shipped
