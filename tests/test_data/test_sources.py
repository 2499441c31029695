"""Real traffic readers: ShareGPT (truncated file), HumanEval, JSONL/Parquet; malformed rows counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.config import DataConfig, SourceConfig
from data.sources import SkipCounter, iter_json_array, read_source, sharegpt_path
from data.split import heldout_score, is_heldout, select


def test_sharegpt_truncated_file_parses_record_by_record() -> None:
    recs = list(iter_json_array(sharegpt_path()))
    complete = [r for r in recs if isinstance(r, dict)]
    assert 17_000 < len(complete) < 18_000  # about 17.6k complete conversations
    assert not isinstance(recs[-1], dict) and recs[-1].reason == "truncated_tail"


def test_sharegpt_reader_counts_skips() -> None:
    skips = SkipCounter()
    data = DataConfig()
    convs = list(read_source("sharegpt", SourceConfig(kind="sharegpt", max_records=2000), data, skips))
    assert convs and all(c.messages[0]["role"] in ("user", "system") for c in convs)
    assert skips.to_dict()["sharegpt"]["empty"] > 0
    assert len(convs) + skips.total() == 2000


def test_humaneval_reader() -> None:
    convs = list(read_source("humaneval", SourceConfig(kind="humaneval"), DataConfig(), SkipCounter()))
    assert len(convs) == 164
    assert convs[0].id == "HumanEval/0" and "```python" in convs[0].messages[0]["content"]


def test_jsonl_malformed_rows_are_counted_not_fatal(tmp_path: Path) -> None:
    good = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"id": "b", "messages": []}),
        json.dumps({"id": "c", "messages": [{"role": "user", "content": 5}]}),
        json.dumps({"id": "d", "messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"id": "e", "messages": [{"role": "user", "content": "x" * 50}]}),
        json.dumps({"id": "f", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
        json.dumps({"prompt": "plain prompt"}),
        json.dumps([1, 2]),
        "",
    ]
    f = tmp_path / "traffic.jsonl"
    f.write_text("\n".join(lines) + "\n")
    skips = SkipCounter()
    data = DataConfig(max_message_chars=20)
    convs = list(read_source("mine", SourceConfig(kind="jsonl", paths=[str(f)]), data, skips))
    assert [c.messages[0]["content"] for c in convs] == ["hi", "plain prompt"]
    assert skips.to_dict()["mine"] == {
        "bad_json": 1,
        "blank_line": 1,
        "empty": 1,
        "message_too_long": 1,
        "non_string_content": 1,
        "not_an_object": 1,
        "roles_out_of_order": 1,
        "unknown_role": 1,
    }


def test_openai_content_parts_and_tool_messages(tmp_path: Path) -> None:
    """Chat-completion logs: text parts of a content list are joined and used; a conversation with an image part,
    a tool result or a tool call is skipped and counted under its own reason."""
    parts = [{"type": "text", "text": "Sum "}, {"type": "text", "text": "2 and 3."}]
    rows = [
        {"id": "parts", "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": ["5", "."]}]},
        {"id": "img", "messages": [{"role": "user", "content": [*parts, {"type": "image_url", "image_url": {}}]}]},
        {"id": "tool", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "{}"}]},
        {"id": "call", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{}]}]},
        {"id": "bad", "messages": [{"role": "user", "content": [{"text": 3}]}]},
        {"id": "p", "prompt": [{"type": "text", "text": "a prompt in parts"}]},
    ]
    f = tmp_path / "log.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    skips = SkipCounter()
    convs = list(read_source("log", SourceConfig(kind="jsonl", paths=[str(f)]), DataConfig(), skips))
    assert [(c.id, c.messages) for c in convs] == [
        ("parts", [{"role": "user", "content": "Sum 2 and 3."}, {"role": "assistant", "content": "5."}]),
        ("p", [{"role": "user", "content": "a prompt in parts"}]),
    ]
    assert skips.to_dict()["log"] == {
        "non_text_content": 1,
        "tool_message": 1,
        "tool_calls": 1,
        "non_string_content": 1,
    }


def test_rows_without_messages_or_prompt_are_named(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.sources import DataError

    f = tmp_path / "wrong.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "x", "text": "hello"}]), f)
    with pytest.raises(DataError, match="no 'messages' or 'prompt' column \\(it has: id, text\\)"):
        list(read_source("w", SourceConfig(kind="jsonl", paths=[str(f)]), DataConfig(), SkipCounter()))
    j = tmp_path / "rows.jsonl"
    j.write_text(json.dumps({"id": "y", "text": "hello"}) + "\n" + json.dumps({"id": "z", "messages": None}) + "\n")
    skips = SkipCounter()
    assert not list(read_source("j", SourceConfig(kind="jsonl", paths=[str(j)]), DataConfig(), skips))
    assert skips.to_dict()["j"] == {"no_messages_or_prompt": 1, "empty": 1}


def test_parquet_source(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "x", "prompt": "hello"}, {"id": "y", "prompt": None}]), f)
    skips = SkipCounter()
    convs = list(read_source("p", SourceConfig(kind="jsonl", paths=[str(f)]), DataConfig(), skips))
    assert [c.id for c in convs] == ["x"] and skips.total() == 1


def test_unknown_kind_and_missing_file_are_clear(tmp_path: Path) -> None:
    from data.config import ConfigError

    with pytest.raises(ConfigError, match="kind='csv' is not one of: sharegpt, humaneval, jsonl"):
        list(read_source("x", SourceConfig(kind="csv"), DataConfig(), SkipCounter()))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="does not exist"):
        list(
            read_source(
                "x", SourceConfig(kind="jsonl", paths=[str(tmp_path / "nope.jsonl")]), DataConfig(), SkipCounter()
            )
        )


def test_heldout_split_is_deterministic_and_disjoint() -> None:
    assert heldout_score("s", "id1", "salt") == heldout_score("s", "id1", "salt")
    assert heldout_score("s", "id1", "salt") != heldout_score("s", "id1", "other")
    data = DataConfig(sources={"humaneval": SourceConfig(kind="humaneval")}, heldout_fraction=0.2, max_heldout=1000)
    a = select(data, SkipCounter())
    b = select(data, SkipCounter())
    assert [c.id for c in a.train] == [c.id for c in b.train]
    train_ids = {c.id for c in a.train}
    held_ids = {c.id for c in a.heldout}
    assert not train_ids & held_ids and len(train_ids) + len(held_ids) == 164
    assert 15 < len(held_ids) < 50
    assert all(is_heldout("humaneval", i, data.split_salt, 0.2) for i in held_ids)
    # A smaller run never trains on a conversation another run holds out.
    small = select(DataConfig(sources=data.sources, heldout_fraction=0.2, num_prompts=10), SkipCounter())
    assert len(small.train) == 10 and not {c.id for c in small.train} & held_ids


def test_mixture_weights() -> None:
    data = DataConfig(
        sources={
            "sharegpt": SourceConfig(kind="sharegpt", weight=3.0, max_records=3000),
            "humaneval": SourceConfig(kind="humaneval", weight=1.0),
        },
        num_prompts=40,
    )
    sel = select(data, SkipCounter())
    by = [c.source for c in sel.train]
    assert by.count("sharegpt") == 30 and by.count("humaneval") == 10
