"""The one Markdown table writer (data/tables.py) that eval, compare, deploy and the benchmark scripts use."""

from __future__ import annotations

import math

import pytest

from data.tables import cell, table


def test_table_lines_and_missing_values() -> None:
    assert table(["", "ours", "peer"], [["tau", 1.5, None], ["steps", "", math.nan]]) == [
        "| | ours | peer |",
        "|---|---|---|",
        "| tau | 1.5 | - |",
        "| steps | | - |",
    ]
    assert cell(0.1234, ".2f", "x") == "0.12x" and cell(float("nan"), ".2f") == "-" and cell(None) == "-"


def test_a_row_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError, match="a row of 1 cells under a header of 2"):
        table(["a", "b"], [["only one"]])
