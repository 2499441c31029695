"""How OpenMP threads wait between parallel regions: chosen before torch loads (libgomp reads it once, at load).

By default libgomp spins ~300,000 times (a few ms) before sleeping. With two processes on two cores that is ruinous:
each one's idle thread spins on the core the other needs (a 64-row decode step of the embedded target went from
0.24 s alone to 1.61 s with a neighbour doing the same; batch-1 steps 0.073 -> 0.36 s). ``OMP_WAIT_POLICY=PASSIVE``
(sleep at once) is safe with neighbours but wakes the threads for every operation, which alone costs 1.2-1.5x
(0.35 s and 0.090 s for the same steps). A short spin keeps most of both: ``GOMP_SPINCOUNT=2000`` (~20 us, the gap
between operations in a forward) gave 0.25 s / 0.077 s alone and 0.45-0.47 s / 0.117 s beside a neighbour
(``scripts/bench_decode_step.py``, 2-core AMD EPYC; BENCHMARKS).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = 2000
"""``GOMP_SPINCOUNT`` set by :func:`set_default_wait`."""


def set_default_wait(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set ``GOMP_SPINCOUNT`` (a short spin, then sleep) unless the user chose how threads wait
    (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` already set, even empty). Call before torch is imported.

    Returns what is in effect, for logs: ``"GOMP_SPINCOUNT=2000"`` or the user's setting."""
    chosen = [f"{k}={environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in environ]
    if chosen:
        return " ".join(chosen)
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return f"GOMP_SPINCOUNT={SPIN_COUNT}"
