"""The three packages are layers that import downwards only: ``data`` <- ``eval`` <- ``train``.

``data`` (target, sources, split, synth, atomic files, manifests, W&B, their configs) imports neither ``eval``
nor ``train``; ``eval`` (decoder, tree, sampling, proposers, replay, metrics, its config) never imports
``train``; ``train`` (drafters, loop, features, export, cluster, CLI, the root config) may import both. Every
import statement counts, at module level, inside functions and under ``TYPE_CHECKING`` alike.

Function-local imports of the project's own modules are allowed only where they keep start-up light: the CLI
(``train/__main__.py`` imports a stage's module, and with it torch, transformers, DeepSpeed or vLLM's client,
only when that stage runs). Drafter families and their export modules are imported by name from the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"data": 0, "eval": 1, "train": 2}
LAZY_OK = {"train/__main__.py"}


def _imports(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) for every absolute import in ``tree``."""
    out: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, in_fn) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child.lineno, child.module, in_fn))
            visit(child, inner)

    visit(tree, False)
    return out


def _project_files() -> list[Path]:
    return sorted(p for top in RANK for p in (ROOT / top).rglob("*.py"))


def test_the_layer_rule_sees_an_upward_import() -> None:
    tree = ast.parse("import torch\ndef f():\n    from train.config import Config\n")
    assert (3, "train.config", True) in _imports(tree)


def test_no_upward_imports() -> None:
    upward = []
    files = _project_files()
    assert len(files) > 40
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        layer = RANK[rel.split("/")[0]]
        for line, module, _ in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            top = module.split(".")[0]
            if top in RANK and RANK[top] > layer:
                upward.append(f"{rel}:{line} imports {module}")
    assert not upward, "imports against the layering data <- eval <- train:\n" + "\n".join(upward)


def test_project_imports_are_at_module_level() -> None:
    local = []
    for path in _project_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in LAZY_OK:
            continue
        for line, module, in_fn in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if in_fn and module.split(".")[0] in RANK:
                local.append(f"{rel}:{line} imports {module} inside a function")
    assert not local, "\n".join(local)
