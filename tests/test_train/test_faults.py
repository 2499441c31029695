"""Fault injection by class, for every stage that writes: a full disk at each kind of write, a SIGKILL after each
kind of write, a Ctrl-C. Each ends as the README says (``error: ...`` in one line, exit 2; exit 130 for Ctrl-C;
nothing half-written left behind) and the stage's rerun -- the same command, ``resume=true`` for stage train --
finishes with exactly the result of a run that was never interrupted.

The writes are found, not listed: a counting run records every output the stage commits (``tests/faults.py``),
and each kind of write (its path with numbers as N) gets the fault at its first occurrence. A new output of a stage
is covered without touching this file. A tiny random Llama target keeps each run to seconds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from data.tiny_target import make_tiny_target
from tests.conftest import TINY_SYNTH, subprocess_env
from tests.faults import kind_of, leftovers, run, write_kinds


def _synth_result(out: Path) -> Any:
    import pyarrow.parquet as pq

    rows = []
    for f in sorted((out / "data").glob("*.parquet")):
        rows += [(r["id"], r["input_ids"]) for r in pq.read_table(f, columns=["id", "input_ids"]).to_pylist()]
    return sorted(rows), (out / "heldout.jsonl").read_text(encoding="utf-8")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(str(path)).items()}


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def _train_result(out: Path) -> Any:
    manifest = json.loads((out / "manifest.json").read_text())
    return [round(x, 5) for _, x in manifest["losses"]], _tensors(out / "best" / "model.safetensors")


def _eval_result(out: Path) -> Any:
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    keep = ("tau", "tau_ci", "alpha", "accepted", "drafted", "identical_to_plain", "new_tokens")
    return {m: {s: {k: v for k, v in r.items() if k in keep} for s, r in per.items()} for m, per in metrics.items()}


def _export_result(out: Path) -> Any:
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    weights = {f: _tensors(out / f) for f in files if f.endswith(".safetensors")}
    config = json.loads((out / "config.json").read_text())
    return files, weights, {k: v for k, v in config.items() if k != "draftsmith"}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensors({"t": a}, {"t": b})
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN (e.g. identical_to_plain in replay mode) on both sides
    return bool(a == b)


class Stage:
    """One stage's command (``args(out, src)``: writing into ``out``, reading the earlier stages' outputs under
    ``src``, by default the reference runs), how to read its result, and how a user reruns it."""

    def __init__(self, name: str, args: Callable[..., list[str]], result: Callable[[Path], Any]) -> None:
        self.name, self.args, self.result = name, args, result

    def rerun_args(self, out: Path) -> list[str]:
        ckpts = out / "checkpoints"
        resumable = self.name == "train" and ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir())
        return [*self.args(out), *(["resume=true"] if resumable else [])]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny target, each stage's uninterrupted reference run (counting its writes), and the stages' commands."""
    root = tmp_path_factory.mktemp("faults")
    env = subprocess_env("disabled")
    target = make_tiny_target("llama", root / "tiny-llama")
    common = ["target=hf", f"target.path={target}", "wandb.mode=disabled", "hydra.output_subdir=null"]
    common += ["train.features=online", f"runs_root={root / 'runs'}"]
    ref = root / "ref"
    stages = {
        "synth": Stage(
            "synth",
            lambda out, src=ref: ["stage=synth", *TINY_SYNTH, "synth.chunk_size=3", *common, f"hydra.run.dir={out}"],
            _synth_result,
        ),
        "train": Stage(
            "train",
            lambda out, src=ref: [
                "stage=train",
                "experiment=quickstart",
                "drafter=eagle3",
                "drafter.draft_vocab_size=512",
                f"synth_dir={src / 'synth'}",
                "train.max_steps=4",
                "train.save_every=2",
                "train.eval_every=2",
                "train.eval_prompts=1",
                "train.eval_max_new_tokens=6",
                "train.micro_batch_size=2",
                *common,
                f"hydra.run.dir={out}",
            ],
            _train_result,
        ),
        "eval": Stage(
            "eval",
            lambda out, src=ref: [
                "stage=eval",
                "experiment=quickstart",
                "drafter=eagle3",
                f"synth_dir={src / 'synth'}",
                f"train_dir={src / 'train'}",
                "eval.mode=replay",
                "eval.num_prompts=2",
                "eval.max_new_tokens=12",
                "eval.bootstrap=50",
                "eval.plot=false",
                *common,
                f"hydra.run.dir={out}",
            ],
            _eval_result,
        ),
        "export": Stage(
            "export",
            lambda out, src=ref: [
                "stage=export",
                "experiment=quickstart",
                "drafter=eagle3",
                "export=speculators",
                f"export.drafter_dir={src / 'train' / 'best'}",
                f"export.out_dir={out / 'speculators'}",
                f"export.eval_dir={src / 'eval'}",
                *common,
                f"hydra.run.dir={out}",
            ],
            lambda out: _export_result(out / "speculators"),
        ),
    }
    commits: dict[str, list[str]] = {}
    for name, stage in stages.items():
        log = root / f"{name}.commits"
        res = run(stage.args(ref / name), env, ref / name, fault="count", log=log)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        commits[name] = log.read_text().split()
    return {"root": root, "env": env, "stages": stages, "commits": commits, "ref": ref}


def _rerun_matches(p: dict[str, Any], stage: Stage, out: Path) -> None:
    again = run(stage.rerun_args(out), p["env"], out)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _equal(stage.result(out), stage.result(p["ref"] / stage.name)), f"{stage.name}: rerun differs"
    assert not leftovers(out), leftovers(out)


def _one_line_error(res: Any, needle: str) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and needle in lines[0], res.stderr[-3000:]


STAGES = ("synth", "train", "eval", "export")


@pytest.mark.parametrize("name", STAGES)
@pytest.mark.parametrize("fault", ["enospc", "kill"])
def test_a_fault_at_each_kind_of_write_then_the_rerun(pipeline: dict[str, Any], name: str, fault: str) -> None:
    """A chain of faults through one run's life, one at each kind of write the stage makes, in the order the stage
    first makes them (the plan, data chunks, their stats, manifests, checkpoints, the best drafter, the report):
    each run gets the fault at its first write of the next kind, and the run after it is the user's rerun.
    ``enospc``: the write fails as on a full disk: exit 2 with one line naming the file, no temporary file left.
    ``kill``: SIGKILL right after the write (a node failure). The last rerun, without a fault, finishes with
    exactly the uninterrupted run's result."""
    p, stage = pipeline, pipeline["stages"][name]
    kinds = write_kinds(p["commits"][name])
    assert kinds, f"stage {name} committed no outputs"
    out = p["root"] / f"{fault}-{name}"
    for i, kind in enumerate(kinds):
        args = stage.args(out) if i == 0 else stage.rerun_args(out)
        res = run(args, p["env"], out, fault=f"{fault}:{kind}")
        if fault == "enospc":
            assert res.returncode == 2, (kind, res.returncode, res.stderr[-3000:])
            _one_line_error(res, "disk full while writing")
            assert not leftovers(out), (kind, leftovers(out))
        else:
            assert res.returncode == -9, (kind, res.returncode, res.stderr[-3000:])
    _rerun_matches(p, stage, out)


@pytest.mark.parametrize("name", ["synth", "train"])
def test_ctrl_c_mid_stage_is_one_line_and_resumable(pipeline: dict[str, Any], name: str) -> None:
    """Ctrl-C (SIGINT) after the stage's second kind of write: exit 130 with one line that says how to go on, and
    the rerun it names finishes with the uninterrupted run's result."""
    p, stage = pipeline, pipeline["stages"][name]
    out = p["root"] / f"int-{name}"
    res = run(stage.args(out), p["env"], out, fault=f"int:{write_kinds(p['commits'][name])[1]}")
    assert res.returncode == 130, res.stderr[-3000:]
    _one_line_error(res, "interrupted")
    _rerun_matches(p, stage, out)


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "missing": lambda f: f.unlink(),
    "truncated": lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
    "wrong type": lambda f: f.write_bytes(
        b"PAR1\x00\x15\x04" * 8 if f.suffix in (".json", ".jsonl", ".md") else b'{"rows": [1, 2, 3]}\n'
    ),
}
"""Classes of bad input file: gone, cut short, another kind of file under its name (JSON where binary is expected,
binary where text is)."""

INPUTS = {"train": ["synth"], "eval": ["synth", "train/best"], "export": ["train/best", "eval"]}
"""The earlier stages' outputs each stage reads."""


@pytest.mark.parametrize("name", ["train", "eval", "export"])
def test_each_kind_of_input_file_when_bad_is_refused_naming_it_or_changes_nothing(
    pipeline: dict[str, Any], name: str
) -> None:
    """Every kind of file in a stage's inputs (found by listing the earlier stages' outputs, not listed here), made
    bad in one of the classes above (the classes rotate over the kinds, so each class meets several kinds): the stage
    either refuses it -- exit 2, one ``error:`` line naming the file or its directory, no traceback, nothing written
    that blocks the rerun -- or finishes with exactly the result of good inputs (a file it does not need). A result
    that silently differs fails. After a refusal, the file restored, the same command finishes with the reference
    result."""
    p, stage = pipeline, pipeline["stages"][name]
    src = p["root"] / f"bad-{name}-src"
    for sub in INPUTS[name]:
        shutil.copytree(p["ref"] / sub, src / sub)
    files: dict[str, Path] = {}
    for sub in INPUTS[name]:
        for f in sorted((src / sub).rglob("*")):
            if f.is_file() and f.name not in (".lock", "__main__.log"):
                files.setdefault(kind_of(f.relative_to(src).as_posix()), f)
    assert len(files) >= 2, files
    refused = 0
    for i, (kind, f) in enumerate(files.items()):
        cls, corrupt = list(CORRUPTIONS.items())[i % len(CORRUPTIONS)]
        out = p["root"] / f"bad-{name}-{i}"
        good = f.read_bytes()
        corrupt(f)
        res = run(stage.args(out, src), p["env"], out)
        f.write_bytes(good)
        if res.returncode == 0:
            assert _equal(stage.result(out), stage.result(p["ref"] / name)), f"{kind} {cls}: another result, silently"
            continue
        assert res.returncode == 2, (kind, cls, res.returncode, res.stderr[-3000:])
        _one_line_error(res, "")
        line = next(ln for ln in res.stderr.splitlines() if ln.startswith("error: "))
        assert f.name in line or str(f.parent) in line or f.parent.name in line, (kind, cls, line)
        refused += 1
        if refused == 1:
            again = run(stage.args(out, src), p["env"], out)
            assert again.returncode == 0, again.stderr[-3000:]
            assert _equal(stage.result(out), stage.result(p["ref"] / name))
    assert refused, f"stage {name}: no bad input refused"
