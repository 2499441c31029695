"""The one Markdown table writer of the project's reports (eval's table, compare, deploy, the benchmark scripts).

>>> print("\\n".join(table(["a", "b"], [[1, "x"], [2.5, None]])))
| a | b |
|---|---|
| 1 | x |
| 2.5 | - |

An empty cell is written ``| |``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

MISSING = "-"
"""What a cell shows for a value that does not exist (None, NaN)."""


def cell(value: Any, spec: str = "", suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (``format(value, spec)``) plus ``suffix``; :data:`MISSING` for None / NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return f"{value:{spec}}{suffix}"


def row(cells: Iterable[Any]) -> str:
    """One table row; a cell that is not a string goes through :func:`cell`."""
    texts = [c if isinstance(c, str) else cell(c) for c in cells]
    return "|" + "".join(f" {t} |" if t else " |" for t in texts)


def table(header: Sequence[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """A Markdown table's lines: the header, its separator, one line per row (each as many cells as the header)."""
    out = [row(header), "|" + "---|" * len(header)]
    for r in rows:
        cells = list(r)
        if len(cells) != len(header):
            raise ValueError(f"a row of {len(cells)} cells under a header of {len(header)}: {cells}")
        out.append(row(cells))
    return out
