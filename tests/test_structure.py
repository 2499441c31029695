"""Structure checks of the library (``data``, ``eval``, ``train``) and of what the scripts and tests reach into.

* No module grows past :data:`HARD_LIMIT` lines, and one past :data:`SOFT_LIMIT` is listed in :data:`ONE_CONCERN`
  with the one thing it does (a new long module, or a listed one that got short again, fails: update the list).
* Run-directory names (``manifest.json``, ``heldout.jsonl``, ...) are spelled only in :mod:`data.layout`.
* ``eval`` takes the model and cache primitives from :mod:`data.modeling`; from the synth engine
  (:mod:`data.generate`) only the engine itself (continuations are generated with it).
* Scripts import no private name (``_x``) of the library; tests patch no ``sys.path``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("data", "eval", "train")
SOFT_LIMIT = 500
HARD_LIMIT = 750
ONE_CONCERN = {
    "data/generate.py": "the continuous-batching engine (prefill groups, shared prefixes, slot cache, admission)",
    "data/synth.py": "stage synth: turns of conversations through the target into chunks, shards, merge",
    "eval/replay.py": "the replay walk (verification per proposer kind, lanes, sampled paths)",
    "eval/run.py": "stage eval's orchestration (methods, prompts, decode and replay, outputs)",
    "train/drafters/eagle3.py": "the EAGLE-3 family (config, module, training-time test loss, proposer hooks)",
    "train/deploy.py": "stage deploy (serving sweep: batch sizes x K in vLLM, the recommendation)",
    "train/loop.py": "the training loop (setup, step, held-out check, result); checkpoints in checkpointing.py",
}
LAYOUT_NAMES = {
    "manifest.json",
    "heldout.jsonl",
    "metrics.json",
    "table.md",
    "acceptance.png",
    "trainer_state.json",
    "stopped.json",
}


def _library_files() -> list[Path]:
    return sorted(p for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py"))


def test_long_modules_do_one_thing() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in _library_files()}
    too_long = {f: n for f, n in lengths.items() if n > HARD_LIMIT}
    assert not too_long, f"split these modules along their seams: {too_long}"
    unlisted = {f: n for f, n in lengths.items() if n > SOFT_LIMIT and f not in ONE_CONCERN}
    assert not unlisted, f"over {SOFT_LIMIT} lines, not in ONE_CONCERN (split it, or name its concern): {unlisted}"
    stale = [f for f in ONE_CONCERN if lengths.get(f, 0) <= SOFT_LIMIT]
    assert not stale, f"no longer over {SOFT_LIMIT} lines: remove from ONE_CONCERN: {stale}"


def test_run_layout_is_named_in_one_place() -> None:
    found = []
    for p in _library_files():
        if p == ROOT / "data" / "layout.py":
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in LAYOUT_NAMES:
                found.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, f"use data.layout's names: {found}"


def test_eval_takes_primitives_from_data_modeling() -> None:
    for p in sorted((ROOT / "eval").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "data.generate":
                names = {a.name for a in node.names}
                assert names <= {"continuous_generate"}, f"{p.relative_to(ROOT)}: {names} (from data.modeling)"


def test_scripts_use_public_names_and_tests_leave_sys_path_alone() -> None:
    private = []
    for p in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARY:
                private += [f"{p.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in {"data", "eval", "train"}:
                    private.append(f"{p.name}: {base.id}.{node.attr}")
    assert not private, f"scripts reach into private names: {private}"
    patched = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                patched.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not patched, f"tests use sys.path: {patched}"
