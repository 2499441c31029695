"""Stage synth on the real SmolLM2 target: greedy identity, loss mask, kill-and-resume, shards + merge."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from data.render import conversation_ids_and_mask, prompt_ids
from data.sources import Conversation
from data.synth import synth_chunk
from data.synth_store import load_synth_dataset
from tests import cli
from tests.conftest import REPO, compose

pytestmark = pytest.mark.slow

SMALL = [
    "experiment=quickstart",
    "data.num_prompts=6",
    "data.max_heldout=2",
    "data.max_turns=2",
    "synth.max_new_tokens=8",
    "synth.chunk_size=2",
    "synth.batch_size=4",
    "data.max_prompt_tokens=160",
]


def test_loss_mask_marks_exactly_the_assistant_tokens(target) -> None:
    tok = target.tokenizer
    msgs = [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "def f():\n    return 1"},
    ]
    ids, mask = conversation_ids_and_mask(tok, msgs, 10_000)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
        "Hi there!<|im_end|>def f():\n    return 1<|im_end|>"
    )
    cut_ids, cut_mask = conversation_ids_and_mask(tok, msgs, 12)
    assert cut_ids == ids[:12] and cut_mask == mask[:12]


def _convs_multi_turn() -> list[Conversation]:
    return [
        Conversation(
            "a",
            "t",
            [
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "orig"},
                {"role": "user", "content": "And of Italy?"},
            ],
        ),
        Conversation("b", "t", [{"role": "user", "content": "Write a haiku about the sea."}]),
        Conversation("c", "t", [{"role": "user", "content": "def add(a, b):"}]),
        Conversation("d", "t", [{"role": "user", "content": "List three prime numbers, please, with reasons."}]),
        Conversation("e", "t", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]),
    ]


@pytest.mark.parametrize("engine", ["hf", "hf_generate"])
def test_greedy_synth_equals_the_targets_own_generate(target, engine: str) -> None:
    """Synth == one-prompt greedy ``generate`` (multi-turn too), with continuous batching (3 rows for 4 prompts:
    a finished row's slot is refilled) and with padded ``generate`` batches."""
    cfg = compose(["synth.max_new_tokens=12", "synth.batch_size=3", f"synth.engine={engine}"])
    convs = _convs_multi_turn()[:4]
    rows, stats = synth_chunk(target, convs, cfg.synth, 512, None)
    assert stats.turns == 5 and len(rows) == 4
    tok = target.tokenizer

    def ref_generate(messages: list[dict[str, str]]) -> list[int]:
        ids = prompt_ids(tok, messages)
        out = target.model.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tok.pad_token_id,
        )[0, len(ids) :].tolist()
        return out[: out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out

    for conv, row in zip(convs, rows, strict=True):
        history: list[dict[str, str]] = []
        users = [m for m in conv.messages if m["role"] == "user"]
        for turn, user in enumerate(users):
            history.append(user)
            expected = ref_generate(history)
            assert row["gen_token_ids"][turn] == expected, (conv.id, turn)
            answer = tok.decode(expected, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})  # conditioned on its own answer
        assert row["messages"] == history
        assert "orig" not in json.dumps(row["messages"])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_streamed_chunks_equal_chunk_by_chunk_synth(target, temperature: float) -> None:
    """engine=hf decodes every chunk through one engine (the next chunk's prompts fill the slots the last one
    leaves; a conversation's next turn is queued when its answer ends): each chunk's rows equal synth_chunk's for
    that chunk alone -- greedy, and sampled too (per-request seeds: a row's draws do not depend on its
    neighbours) -- and its chunk is handed over once, when its last turn ends."""
    from data.synth import synth_stream

    cfg = compose(["synth.max_new_tokens=10", "synth.batch_size=3", f"synth.temperature={temperature}"])
    convs = _convs_multi_turn()
    chunks = [(0, convs[:2], [True, True]), (1, convs[2:4], [True, True]), (2, convs[4:], [False])]
    expected = {i: synth_chunk(target, c, cfg.synth, 512, None, flags, seed=7) for i, c, flags in chunks}
    got: dict[int, tuple] = {}

    def on_chunk(i: int, rows: list, stats) -> None:
        assert i not in got
        got[i] = (rows, stats)

    synth_stream(target, chunks, cfg.synth, 512, None, on_chunk, seed=7)
    assert sorted(got) == [0, 1, 2]
    for i in got:
        rows, stats = got[i]
        ref_rows, ref_stats = expected[i]
        assert rows == ref_rows, i
        assert (stats.turns, stats.generated_tokens, stats.prompt_tokens) == (
            ref_stats.turns,
            ref_stats.generated_tokens,
            ref_stats.prompt_tokens,
        )
        assert stats.gen_seconds >= 0
    assert got[0][1].turns == 3 and got[2][1].rows_original == 1  # two turns of "a"; "e" kept as it was
    if temperature:  # sampled, not greedy: the seeds matter
        greedy = synth_chunk(target, convs[:2], compose(["synth.max_new_tokens=10"]).synth, 512, None, seed=7)[0]
        assert [r["gen_token_ids"] for r in greedy] != [r["gen_token_ids"] for r in got[0][0]]


def _synth(run_dir: Path, env: dict[str, str], *extra: str, small: list[str] = SMALL) -> subprocess.Popen[str]:
    return cli.start(["stage=synth", *small, f"hydra.run.dir={run_dir}", *extra], env, merge_stderr=True)


def _rows(run_dir: Path) -> list[dict]:
    ds = load_synth_dataset(run_dir)
    return sorted(ds.to_list(), key=lambda r: (r["source"], r["id"]))


def test_kill_resume_and_shards_give_the_same_dataset(tmp_path: Path, run_env: dict[str, str]) -> None:
    ref_dir, killed_dir, shard_dir = tmp_path / "ref", tmp_path / "killed", tmp_path / "sharded"
    ref = _synth(ref_dir, run_env)
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out
    manifest = json.loads((ref_dir / "manifest.json").read_text())
    assert manifest["counts"]["rows"] == 6 and manifest["counts"]["chunks"] == 3
    assert manifest["target"]["fingerprint"] and manifest["timings"]["generated_tokens_per_second"] > 0
    assert manifest["skipped"]["sharegpt"]["empty"] > 0  # malformed ShareGPT rows are counted
    heldout = [json.loads(x) for x in (ref_dir / "heldout.jsonl").read_text().splitlines()]
    train_ids = {(r["source"], r["id"]) for r in _rows(ref_dir)}
    assert heldout and not train_ids & {(h["source"], h["id"]) for h in heldout}

    # Kill a run right after its first chunk lands (chunks decode together, so any may land first); the restart
    # skips what landed and finishes the rest.
    proc = _synth(killed_dir, run_env)
    deadline = time.time() + 600
    while not list((killed_dir / "data").glob("chunk-*.parquet")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = sorted(p.name for p in (killed_dir / "data").glob("chunk-*.parquet"))
    assert 1 <= len(done_before) < 3
    assert not (killed_dir / "manifest.json").exists()
    assert not list((killed_dir / "data").glob(".*tmp*"))  # nothing half-written under a final name
    resumed = _synth(killed_dir, run_env)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert f"{len(done_before)} already done" in out
    assert _rows(killed_dir) == _rows(ref_dir)

    # Two shards (as two SLURM array tasks would run them), then the merge step.
    for i in (0, 1):
        p = _synth(shard_dir, run_env, "synth.num_shards=2", f"synth.shard_index={i}")
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
    merge = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "stage=merge",
            *SMALL,
            f"synth_dir={shard_dir}",
            f"hydra.run.dir={tmp_path / 'merge'}",
        ],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merge.returncode == 0, merge.stdout + merge.stderr
    assert _rows(shard_dir) == _rows(ref_dir)

    # A different config into the same directory is refused (nothing is lost).
    clash = _synth(ref_dir, run_env, "synth.max_new_tokens=9")
    out, _ = clash.communicate(timeout=600)
    assert clash.returncode != 0 and "different config" in out


def test_mixed_regenerated_and_original_answers(target) -> None:
    """data.sources.<name>.regenerate picks, by hashed id, which conversations the target answers; the others
    keep the dataset's own answers (no generation) and are counted apart."""
    from data.synth import regenerate_flags

    cfg = compose(
        ["synth.max_new_tokens=6", "synth.batch_size=4", "data=sharegpt", "data.sources.sharegpt.regenerate=0.5"]
    )
    convs = [
        Conversation(
            f"c{i}",
            "sharegpt",
            [{"role": "user", "content": f"Name a colour number {i}."}, {"role": "assistant", "content": f"orig {i}"}],
        )
        for i in range(12)
    ]
    flags = regenerate_flags(cfg.data, cfg.synth, convs)
    assert 0 < sum(flags) < len(flags)
    assert regenerate_flags(cfg.data, cfg.synth, convs[::-1]) == flags[::-1]  # by id, not by position
    rows, stats = synth_chunk(target, convs, cfg.synth, 512, None, flags)
    assert stats.rows_regenerated == sum(flags) and stats.rows_original == len(flags) - sum(flags)
    assert stats.turns == sum(flags)  # nothing generated for the original rows
    for conv, flag, row in zip(convs, flags, rows, strict=True):
        assert row["regenerated"] is flag
        answer = row["messages"][-1]["content"]
        assert (answer == conv.messages[-1]["content"]) is (not flag)
        assert bool(row["gen_token_ids"]) is flag
    assert stats.original_target_tokens == sum(r["num_target_tokens"] for r in rows if not r["regenerated"])
