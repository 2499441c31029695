"""Build the long-context probe: code-completion prompts from real source files no one here wrote.

    python scripts/build_long_probe.py [--out eval/probes/long_context.jsonl] [--rows 24] [--min-tokens 1024]
        [--max-tokens 6144] [target.* overrides ...]

Each row asks the target to continue a file of Python's own standard library (the installed interpreter's, read
from ``sysconfig``'s stdlib path): the first lines of the file, as many as fit a token budget, inside a user turn.
Budgets are spread evenly over [min_tokens, max_tokens] (counted with the target's chat template), files are
picked in a fixed pseudo-random order of their paths (sha256), so the same interpreter and target give the same
probe. Rows carry ``source: long_code``, the id ``<path relative to stdlib>:1-<last line>`` and the Python
version; judge with ``python -m train stage=eval eval.prompts=eval/probes/long_context.jsonl data.max_prompt_tokens=8192
data.max_message_chars=40000`` (a 6k-token file head is ~25k characters, over the default limit of a message).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_text
from data.render import prompt_ids

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
ASK = "Continue this Python file from exactly where it stops. Reply with the code only.\n\n```python\n"


def stdlib_files(root: Path) -> list[Path]:
    """Plain-source stdlib modules (no tests, no site-packages), in a fixed order of their paths' sha256."""
    # encodings/ and pydoc_data/ are generated tables, not code anyone reads or writes
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings", "pydoc_data")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest())


def messages_for(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": ASK + text}]


def head_within(lines: list[str], budget: int, count: Callable[[str], int]) -> int:
    """The most leading lines whose prompt fits ``budget`` tokens (binary search; ``count`` is monotone)."""
    lo, hi = 0, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count("".join(lines[:mid])) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def build(tokenizer: Any, rows: int, min_tokens: int, max_tokens: int, root: Path | None = None) -> list[dict]:
    """``rows`` prompts with budgets spread over [min_tokens, max_tokens]; each file used once. A file too short
    to reach 90% of its budget is passed over."""
    root = root or Path(sysconfig.get_paths()["stdlib"])

    def count(text: str) -> int:
        return len(prompt_ids(tokenizer, messages_for(text)))

    budgets = [min_tokens + (max_tokens - min_tokens) * i // max(1, rows - 1) for i in range(rows)]
    out: list[dict] = []
    files = iter(stdlib_files(root))
    for budget in budgets:
        for path in files:
            try:
                lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            except (UnicodeDecodeError, OSError):
                continue
            n = head_within(lines, budget, count)
            text = "".join(lines[:n])
            if n == len(lines) or count(text) < 0.9 * budget:
                continue  # the whole file fits (nothing to continue) or it is too short for this budget
            rel = path.relative_to(root).as_posix()
            row = {"id": f"{rel}:1-{n}", "source": "long_code", "python": platform.python_version()}
            out.append({**row, "messages": messages_for(text)})
            break
    if len(out) < rows:
        raise SystemExit(f"only {len(out)} of {rows} stdlib files fit budgets up to {max_tokens} tokens")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "eval" / "probes" / "long_context.jsonl"))
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=6144)
    args, overrides = ap.parse_known_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from data.target import load_tokenizer
    from train.config import compose_config

    tokenizer = load_tokenizer(compose_config(overrides).target)
    rows = build(tokenizer, args.rows, args.min_tokens, args.max_tokens)
    atomic_write_text(Path(args.out), "".join(json.dumps(r) + "\n" for r in rows))
    logger.info("%d rows -> %s", len(rows), args.out)


if __name__ == "__main__":
    main()
