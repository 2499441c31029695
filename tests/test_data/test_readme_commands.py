"""Every `python -m train ...` command in the README's bash blocks passes the CLI's own checks as written (known
keys and stages, config groups that exist, values of the right type, Hydra composing it): the README cannot name a
key, option or value the code no longer has. Shell variables set in the same block (``Q="..."``) are expanded as
the shell would. Running the commands is other tests' work (the quickstart: test_pipeline; the Train examples'
families: their own files); this check costs well under a second."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import REPO

LAUNCH = re.compile(r"^(?:bash scripts/setup\.sh && )?(?:python3?|torchrun(?: --\S+(?: \S+)?)*) -m train\b")


def readme_commands() -> list[tuple[int, list[str]]]:
    """(line number, the arguments after ``-m train``) of each command in the README's ```bash blocks."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
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
    assert len(cmds) >= 10, cmds  # the quickstart, the stages, the Train examples, your own target
    assert any("deepspeed=zero3" in args for _, args in cmds)  # a torchrun line is parsed too


@pytest.mark.parametrize(("line", "args"), readme_commands(), ids=lambda v: f"L{v}" if isinstance(v, int) else "")
def test_readme_command_passes_the_cli_checks(line: int, args: list[str]) -> None:
    from train.__main__ import preflight

    assert not any("$" in a for a in args), f"README line {line}: an unexpanded shell variable in {args}"
    if args == ["stage=help"]:  # answered by the CLI before any check (it lists the stages)
        from train.__main__ import stage_help

        assert "synth" in stage_help() and "export" in stage_help()
        return
    preflight(args)  # raises ConfigError naming the key, value or option
