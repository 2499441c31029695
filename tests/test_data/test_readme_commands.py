"""Every `python -m train ...` command in the bash blocks of the README and of docs/*.md passes the CLI's own checks
as written (known keys and stages, config groups that exist, values of the right type, Hydra composing it): the
documents cannot name a key, option or value the code no longer has. Shell variables set in the same block
(``Q="..."``) are expanded as the shell would. Running the commands is other tests' work (the quickstart:
test_pipeline; the families' examples: their own files); this check costs well under a second."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO

LAUNCH = re.compile(r"^(?:bash scripts/setup\.sh && )?(?:python3?|torchrun(?: --\S+(?: \S+)?)*) -m train\b")


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""The user's documents (docs/log/ is the dated record: its commands are as they were run)."""


def readme_commands() -> list[tuple[str, list[str]]]:
    """(file:line, the arguments after ``-m train``) of each command in the documents' ```bash blocks."""
    return [(f"{path.relative_to(REPO)}:{line}", args) for path in DOCS for line, args in file_commands(path)]


def file_commands(path: Path) -> list[tuple[int, list[str]]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[tuple[int, list[str]]] = []
    in_block, env = False, {}
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_block, env = line.strip() == "```bash", {}
            i += 1
            continue
        if not in_block:
            i += 1
            continue
        start, text = i + 1, line
        while text.rstrip().endswith("\\") and i + 1 < len(lines):  # continuation lines
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        text = text.split("  #")[0].strip()  # the README's trailing comments
        assign = re.match(r"^([A-Z_]+)=(.*)$", text)
        if assign:
            env[assign.group(1)] = " ".join(shlex.split(assign.group(2)))
            continue
        m = LAUNCH.match(text)
        if not m:
            continue
        rest = re.sub(r"\$([A-Z_]+)", lambda v, env=env: env.get(v.group(1), v.group(0)), text[m.end() :])
        out.append((start, shlex.split(rest)))
    return out


def test_the_readme_has_commands_to_check() -> None:
    cmds = readme_commands()
    readme = [args for where, args in cmds if where.startswith("README.md:")]
    assert len(readme) >= 10, readme  # the quickstart, the stages, the families' examples, your own target
    assert ["stage=all", "experiment=quickstart"] in readme
    assert any("deepspeed=zero3" in args for args in readme)  # a torchrun line is parsed too


@pytest.mark.parametrize(("line", "args"), readme_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_readme_command_passes_the_cli_checks(line: str, args: list[str]) -> None:
    from train.__main__ import preflight

    assert not any("$" in a for a in args), f"{line}: an unexpanded shell variable in {args}"
    if args == ["stage=help"]:  # answered by the CLI before any check (it lists the stages)
        from train.__main__ import stage_help

        assert "synth" in stage_help() and "export" in stage_help()
        return
    preflight(args)  # raises ConfigError naming the key, value or option
