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
