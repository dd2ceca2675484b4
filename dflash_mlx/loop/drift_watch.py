"""Watching a generation's cycles against the cost curve (``cost_curve.py``):
when the machine drifts from what was measured (load, another power state),
the adaptive block policy scales the curve by what it observes, and the
measured curve is forgotten so the next generation measures it again."""

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from .cost_curve import CostCurve

DRIFT = 1.5  # observed over predicted cycle seconds past this, or under its inverse: drifted
DRIFT_WINDOW = 32  # the last cycles of a kind (plain, speculative) whose median ratio is judged


class DriftWatch:
    """Times the loop's cycles against the curve (the interval between the
    ends of consecutive cycles, as the host sees them) and tells when they
    drifted from it: when the median ratio of observed to predicted seconds
    over the last ``DRIFT_WINDOW`` plain steps, or speculative cycles, lies
    past ``DRIFT`` either way (a loaded machine, another power state). Then
    ``on_drift`` runs once (``forget``: the next generation measures the curve
    again) and ``factor`` gives each kind's median ratio from then on (to 1/8
    of an octave; 1 for a kind not yet timed three times, so that the policy
    tries it rather than assume it drifted alike), by which the policy scales
    the curve for the rest of the run. With ``rescale=False`` (a sampled
    generation: its seeded draws follow the blocks, so the blocks must not
    follow timings) the factors stay 1 and only ``on_drift`` runs."""

    def __init__(self, curve: CostCurve, on_drift: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter, window: int = DRIFT_WINDOW,
                 tolerance: float = DRIFT, rescale: bool = True):
        self.curve = curve
        self.on_drift = on_drift
        self.rescale = rescale
        self.clock = clock
        self.tolerance = tolerance
        self.ratios = {False: deque(maxlen=window), True: deque(maxlen=window)}  # by b > 1
        self.last: Optional[float] = None
        self.drifted = False
        self.factors = (1.0, 1.0)

    def cycle_done(self, block_size: int, context: int) -> None:
        now = self.clock()
        if self.last is not None:
            ratios = self.ratios[block_size > 1]
            ratios.append((now - self.last) / self.curve.cycle_seconds(block_size, context))
            if not self.drifted and len(ratios) == ratios.maxlen:
                median = statistics.median(ratios)
                if not 1 / self.tolerance <= median <= self.tolerance:
                    self.drifted = True
                    if self.on_drift:
                        self.on_drift()
            if self.drifted and self.rescale:
                self._rescale()
        self.last = now

    def _rescale(self) -> None:
        step = lambda r: 2 ** (round(math.log2(max(statistics.median(r), 1e-9)) * 8) / 8)  # noqa: E731
        self.factors = tuple(step(self.ratios[kind]) if len(self.ratios[kind]) >= 3 else 1.0
                             for kind in (False, True))

    def factor(self, block_size: int) -> float:
        return self.factors[block_size > 1]


@dataclass(frozen=True)
class Watched:
    """A given curve each generation watches for drift as it does the measured
    one, with nothing cached to forget (bench's auto runs: priced as a user's)."""

    curve: CostCurve
