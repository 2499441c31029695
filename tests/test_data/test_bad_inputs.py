"""Bad input files (issue 12): a bad byte skips one row (counted, with file and line), a fake .parquet or .gz is
named with a one-line cause, a directory is called a directory, an empty or all-bad file says why nothing was
selected, and path errors surface before the target loads."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from data.config import ConfigError, DataConfig, SourceConfig
from data.sources import DataError, SkipCounter, read_source
from tests import cli
from tests.conftest import compose

GOOD = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}


def _read(path: str, skips: SkipCounter | None = None) -> list:
    return list(read_source("mine", SourceConfig(kind="jsonl", paths=[path]), DataConfig(), skips or SkipCounter()))


def test_bad_utf8_byte_skips_only_its_row_and_names_file_and_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "t.jsonl"
    rows = [json.dumps({**GOOD, "id": i}).encode() for i in range(4)]
    rows[2] = rows[2].replace(b"colour", b"col\xffour")
    f.write_bytes(b"\n".join(rows) + b"\n")
    skips = SkipCounter()
    with caplog.at_level("WARNING"):
        convs = _read(str(f), skips)
    assert [c.id for c in convs] == ["0", "1", "3"]
    assert skips.to_dict() == {"mine": {"bad_utf8": 1}}
    assert f"{f}:3: row skipped (bad_utf8" in caplog.text


def test_bad_json_lines_name_file_and_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(GOOD) + "\n{not json\n")
    with caplog.at_level("WARNING"):
        assert len(_read(str(f))) == 1
    assert f"{f}:2: row skipped (bad_json" in caplog.text


@pytest.mark.parametrize("name", ["fake.parquet", "fake.jsonl.gz"])
def test_fake_parquet_or_gzip_is_named_with_a_cause(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(DataError) as err:
        _read(str(f))
    msg = str(err.value)
    assert msg.startswith(f"{f}: not a readable") and "Hint:" in msg and "\n" not in msg


def test_directory_is_called_a_directory_and_globs_skip_directories(tmp_path: Path) -> None:
    (tmp_path / "sub.jsonl").mkdir()
    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        _read(str(tmp_path / "sub.jsonl"))
    assert len(_read(str(tmp_path / "*.jsonl"))) == 1  # the matching directory is skipped, not fatal


def _synth(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return cli.run(["stage=synth", f"hydra.run.dir={tmp_path / 'out'}", *args], timeout=300)


def test_missing_file_fails_before_the_target_loads(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    res = _synth(["data=jsonl", f"data.sources.mine.paths=[{tmp_path}/nope.jsonl]"], tmp_path)
    assert res.returncode == 2 and "nope.jsonl does not exist" in res.stderr and "Traceback" not in res.stderr
    assert "loaded from" not in res.stdout + res.stderr and time.perf_counter() - t0 < 60


@pytest.mark.slow
def test_empty_or_all_bad_traffic_says_why_nothing_was_selected(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"{oops\n\xff\xfe\n")
    res = _synth(["data=jsonl", f"data.sources.mine.paths=[{empty},{bad}]"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert f"{empty} is empty (0 rows)" in out
    assert "No training conversations selected (mine: 0 valid rows" in out
    assert "'bad_json': 1" in out and "'bad_utf8': 1" in out


def test_check_data_rejects_bad_values_cheaply(tmp_path: Path) -> None:
    from data.split import check_data

    with pytest.raises(ConfigError, match="heldout_fraction"):
        check_data(compose(["data.heldout_fraction=1.5"]).data)
    with pytest.raises(Exception) as err:  # an unknown source kind is refused when Hydra composes
        compose(["data=jsonl", "data.sources.mine.paths=[x]", "data.sources.mine.kind=csv"])
    assert "Invalid value 'csv', expected one of [sharegpt, humaneval, jsonl]" in str(err.value.__cause__)


def _synth_output(out: Path, rows_per_chunk: list[int]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (out / "data").mkdir(parents=True)
    for i, n in enumerate(rows_per_chunk):
        table = pa.table({"input_ids": [[1, 2, 3]] * n, "loss_mask": [[0, 1, 1]] * n})
        pq.write_table(table, out / "data" / f"chunk-{i:05d}.parquet")
    (out / "heldout.jsonl").write_text("".join(json.dumps({**GOOD, "source": "s", "id": i}) + "\n" for i in range(2)))
    counts = {"chunks": len(rows_per_chunk), "rows": sum(rows_per_chunk), "heldout": 2}
    (out / "manifest.json").write_text(json.dumps({"stage": "synth", "counts": counts}))


@pytest.mark.parametrize(
    "damage", ["missing", "truncated", "not parquet", "fewer rows", "extra chunk", "held-out cut", "held-out row gone"]
)
def test_a_damaged_synth_chunk_is_named_not_trained_around(tmp_path: Path, damage: str) -> None:
    """Training reads every chunk its manifest counts, or none: a chunk gone, cut short, replaced by another file or
    by one with other rows, or one the run never wrote, is a user error naming it -- not a run on part of the data."""
    from data.synth_store import check_synth_output, synth_chunks
    from train.batches import load_rows

    out = tmp_path / "synth"
    _synth_output(out, [3, 3, 2])
    assert [f.name for f in synth_chunks(out)] == [f"chunk-0000{i}.parquet" for i in range(3)]
    assert len(load_rows(out, 16)) == 8
    chunk = out / "data" / "chunk-00001.parquet"
    if damage == "missing":
        chunk.unlink()
    elif damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    elif damage == "not parquet":
        chunk.write_text('{"input_ids": [1, 2]}\n')
    elif damage == "fewer rows":
        _synth_output(tmp_path / "other", [1])
        chunk.write_bytes((tmp_path / "other" / "data" / "chunk-00000.parquet").read_bytes())
    elif damage == "extra chunk":
        chunk = out / "data" / "chunk-00003.parquet"
        chunk.write_bytes((out / "data" / "chunk-00000.parquet").read_bytes())
    else:
        chunk = out / "heldout.jsonl"
        text = chunk.read_text()
        chunk.write_text(text[: len(text) - 20] if damage == "held-out cut" else text.splitlines(keepends=True)[0])
    with pytest.raises(ConfigError) as err:
        check_synth_output(out) if damage.startswith("held-out") else load_rows(out, 16)
    msg = str(err.value)
    named = "holds 6 rows where its manifest counts 8" if damage == "fewer rows" else chunk.name
    assert named in msg and ("stage=synth" in msg or "remove it" in msg), msg
