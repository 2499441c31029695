"""data.heldout_max_turns: the held-out split keeps later turns for stage eval to judge, while every training row
(which conversations, their messages, the synth plan) stays what it was. On the shipped ShareGPT traffic."""

from __future__ import annotations

import itertools

from data.config import DataConfig, SourceConfig
from data.sources import Skip, SkipCounter, iter_json_array, normalise_messages, sharegpt_path, truncate_turns
from data.split import select
from data.synth_store import plan_hash
from tests.conftest import compose


def _normalised(raw: object, max_turns: int, keep: int | None) -> list[dict[str, str]] | str:
    try:
        return normalise_messages(raw, 16000, max_turns, keep)
    except Skip as s:
        return s.reason


def test_keeping_later_turns_changes_no_rows_validity_or_first_turns() -> None:
    """On the first 3,000 ShareGPT records: a row is valid (or skipped for the same reason) whether or not later
    turns are kept, and the kept turns cut back to max_turns are exactly what max_turns alone gives."""
    longer = 0
    for rec in itertools.islice(iter_json_array(sharegpt_path()), 3000):
        if isinstance(rec, Skip) or not isinstance(rec, dict):
            continue
        raw = rec.get("conversations")
        for max_turns in (1, 2):
            short, long = _normalised(raw, max_turns, None), _normalised(raw, max_turns, 6)
            if isinstance(short, str):
                assert long == short
                continue
            assert not isinstance(long, str)
            assert truncate_turns(long, max_turns) == short
            users = [m for m in long if m["role"] == "user"]
            assert len(users) <= 6 and all(m["content"].strip() for m in users)
            longer += len(long) > len(short)
    assert longer > 300  # multi-turn conversations are common in this traffic


def test_an_empty_later_turn_ends_the_kept_turns_instead_of_skipping_the_row() -> None:
    raw = [
        {"from": "human", "value": "first"},
        {"from": "gpt", "value": "answer"},
        {"from": "human", "value": "second"},
        {"from": "gpt", "value": "answer 2"},
        {"from": "human", "value": "  "},
        {"from": "gpt", "value": "answer 3"},
    ]
    assert [m["content"] for m in normalise_messages(raw, 100, 1, 4)] == ["first", "answer", "second", "answer 2"]
    assert _normalised(raw, 3, None) == "empty_message"  # inside max_turns it is still a malformed row
    assert truncate_turns(normalise_messages(raw, 100, 1, 4), 1) == normalise_messages(raw, 100, 1)


def _data(**kw: object) -> DataConfig:
    src = {"sharegpt": SourceConfig(kind="sharegpt", max_records=4000)}
    return DataConfig(sources=src, num_prompts=60, max_turns=1, heldout_fraction=0.1, max_heldout=40, **kw)


def test_the_split_trains_on_the_same_rows_and_holds_out_later_turns() -> None:
    base = select(_data(), SkipCounter())
    more = select(_data(heldout_max_turns=3), SkipCounter())
    assert [(c.id, c.messages) for c in more.train] == [(c.id, c.messages) for c in base.train]
    assert [c.id for c in more.heldout] == [c.id for c in base.heldout]
    assert [truncate_turns(c.messages, 1) for c in more.heldout] == [c.messages for c in base.heldout]
    turns = [c.num_user_turns() for c in more.heldout]
    assert max(turns) == 3 and min(turns) >= 1 and all(c.num_user_turns() == 1 for c in base.heldout)
    assert all(c.num_user_turns() == 1 for c in more.train)


def test_the_synth_plan_does_not_depend_on_the_held_out_turns() -> None:
    """Raising data.heldout_max_turns after synth must not make a finished synth run refuse to resume."""
    ids = [("sharegpt", "a"), ("sharegpt", "b")]
    a = compose(["experiment=quickstart"])
    b = compose(["experiment=quickstart", "data.heldout_max_turns=4"])
    assert b.data.heldout_max_turns == 4 and plan_hash(a, "fp", ids) == plan_hash(b, "fp", ids)
    c = compose(["experiment=quickstart", "data.max_turns=2"])
    assert plan_hash(c, "fp", ids) != plan_hash(a, "fp", ids)  # the training turns do count
