"""Watching the cycles against the cost curve (``cost_curve.py``): a greedy
generation weighs each kind of cycle (plain steps, speculative cycles) at the
cost this process observed for it on the curve, once enough were timed; when
the machine drifts far from what was measured (load, another power state),
the measured curve is forgotten so the next generation measures it again.

The curve is measured in a few seconds on a machine whose speed wanders; the
loop then runs its cycles for as long as it generates. On the demo pair with
two OpenBLAS threads, curves measured a minute apart priced a cycle at b = 8
at 2.7-4.1 plain steps where the loop ran it at about 2.5, and a curve that
priced it high kept auto plain where b = 8 was 1.5x mlx-lm. A greedy reply is
the target's own tokens whatever the blocks (but for float near-ties between
a pass over b tokens and over one), so its blocks may follow timings. A
sampled one's seeded draws follow the blocks: it is weighed by the curve and
the outcomes alone, so a seed gives the same tokens however loaded the
machine is or whatever ran before it in the process.
"""

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .cost_curve import CostCurve

DRIFT = 1.5  # observed over predicted cycle seconds past this, or under its inverse: drifted
DRIFT_WINDOW = 32  # the last cycles of a kind (plain, speculative) whose median ratio is judged
SETTLED = 8  # cycles of a kind the process timed on a curve before a greedy generation weighs it as observed


@dataclass
class CycleTimes:
    """Observed over predicted seconds of the last cycles of each kind (by b > 1)."""

    window: int = DRIFT_WINDOW
    ratios: dict = field(default_factory=dict)

    def of(self, speculative: bool) -> deque:
        return self.ratios.setdefault(speculative, deque(maxlen=self.window))


_TIMES: dict = {}  # curve -> CycleTimes: the cycles every greedy generation of this process timed on it


def times_for(curve) -> CycleTimes:
    """The cycles this process's greedy generations timed on ``curve`` (a
    ``CostCurve``, or a batch's ``BatchCycles``; equal ones share them)."""
    return _TIMES.setdefault(curve, CycleTimes())


class DriftWatch:
    """Times the loop's cycles against the curve (the interval between the
    ends of consecutive cycles, as the host sees them) and tells when they
    drifted from it: when the median ratio of observed to predicted seconds
    over the last ``DRIFT_WINDOW`` plain steps, or speculative cycles, lies
    past ``DRIFT`` either way (a loaded machine, another power state). Then
    ``on_drift`` runs once (``forget``: the next generation measures the curve
    again).

    ``factor`` is each kind's observed over predicted seconds (to 1/8 of an
    octave), by which the policy scales the curve: after a drift, this
    generation's own median (1 for a kind not yet timed three times, so that
    the policy tries it rather than assume it drifted alike); before, given
    ``times`` (a greedy generation: ``times_for`` the curve, every such
    generation's cycles in this process), their median once ``SETTLED``
    cycles of the kind were timed, a kind timed fewer times taken to be off
    the curve as far as the other (scaling one kind alone would make the other
    look cheaper than it is). With ``rescale=False`` (a sampled generation:
    its seeded draws follow the blocks, so the blocks must not follow timings)
    the factors stay 1 and only ``on_drift`` runs."""

    def __init__(self, curve: CostCurve, on_drift: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter, window: int = DRIFT_WINDOW,
                 tolerance: float = DRIFT, rescale: bool = True, times: Optional[CycleTimes] = None):
        self.curve = curve
        self.on_drift = on_drift
        self.rescale = rescale
        self.times = times if rescale else None
        self.clock = clock
        self.tolerance = tolerance
        self.ratios = {False: deque(maxlen=window), True: deque(maxlen=window)}  # by b > 1
        self.last: Optional[float] = None
        self.drifted = False
        self.factors = (1.0, 1.0)
        self._rescale()

    def cycle_done(self, block_size: int, context: int) -> None:
        now = self.clock()
        if self.last is not None:
            kind = block_size > 1
            ratio = (now - self.last) / self.curve.cycle_seconds(block_size, context)
            self.ratios[kind].append(ratio)
            if self.times is not None:
                self.times.of(kind).append(ratio)
            if not self.drifted and len(self.ratios[kind]) == self.ratios[kind].maxlen:
                median = statistics.median(self.ratios[kind])
                if not 1 / self.tolerance <= median <= self.tolerance:
                    self.drifted = True
                    if self.on_drift:
                        self.on_drift()
            self._rescale()
        self.last = now

    def _rescale(self) -> None:
        step = lambda r: 2 ** (round(math.log2(max(statistics.median(r), 1e-9)) * 8) / 8)  # noqa: E731
        if not self.rescale:
            return
        if self.drifted:
            self.factors = tuple(step(self.ratios[kind]) if len(self.ratios[kind]) >= 3 else 1.0
                                 for kind in (False, True))
        elif self.times is not None:
            plain, speculative = (step(r) if len(r) >= SETTLED else None
                                  for r in (self.times.of(False), self.times.of(True)))
            self.factors = (plain or speculative or 1.0, speculative or plain or 1.0)

    def factor(self, block_size: int) -> float:
        return self.factors[block_size > 1]


@dataclass(frozen=True)
class Watched:
    """A given curve each generation watches for drift as it does the measured
    one, with nothing cached to forget (bench's auto runs: priced as a user's)."""

    curve: CostCurve
