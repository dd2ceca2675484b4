"""Watching the cycles against the cost curve (``cost_curve.py``): the
adaptive block policy weighs each kind of cycle (plain steps, speculative
cycles) at the cost observed for it, once enough of them were timed, and when
the machine drifted far from what was measured (load, another power state)
the measured curve is forgotten so the next generation measures it again.

The curve is measured in about a second, pass by pass; the loop then runs the
passes back to back, the draft of the next block queued behind the verify
pass. On the demo pair with one OpenBLAS thread a curve measured on a quiet
machine priced a cycle at b = 8 at 4.8 plain steps and one at 16 at 6.4,
while the loop ran them in about 3.2 and 4.0: priced so, auto stayed plain
where both fixed blocks were 1.2-1.3x faster than mlx-lm. So the observed
ratio is always applied, not only past the drift threshold, and it is kept
per curve for the whole process: a generation starts from what the ones
before it observed."""

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .cost_curve import CostCurve

DRIFT = 1.5  # observed over predicted cycle seconds past this, or under its inverse: drifted
DRIFT_WINDOW = 32  # the last cycles of a kind (plain, speculative) whose median ratio is judged
SETTLED = 8  # cycles of a kind timed before its observed ratio replaces the curve's price


@dataclass
class CycleTimes:
    """Observed over predicted seconds of the last cycles of each kind (by b > 1)."""

    window: int = DRIFT_WINDOW
    ratios: dict = field(default_factory=dict)

    def of(self, speculative: bool) -> deque:
        return self.ratios.setdefault(speculative, deque(maxlen=self.window))


_TIMES: dict = {}  # curve -> CycleTimes: every generation of this process timed against it


def times_for(curve: CostCurve) -> CycleTimes:
    """The cycles this process timed against ``curve`` (equal curves share them)."""
    return _TIMES.setdefault(curve, CycleTimes())


class DriftWatch:
    """Times the loop's cycles against the curve (the interval between the
    ends of consecutive cycles, as the host sees them) into ``times`` (shared
    by the generations that pass the same, default: this watch's own). Once
    ``SETTLED`` cycles of a kind were timed, ``factor`` gives their median
    ratio of observed to predicted seconds (to 1/8 of an octave), by which the
    policy scales the curve; a kind timed fewer times is taken to be off the
    curve as far as the other kind is (priced as the curve says while neither
    settled): scaling one kind alone would make the other look cheaper than it
    is (at a long context, where the curve's extrapolated slope underprices the
    plain steps, verified probes would then come every few steps). When the median over the last ``window`` cycles of a kind lies past
    ``DRIFT`` either way, ``on_drift`` runs once (``forget``: the next
    generation measures the curve again).

    With ``weigh=False`` (a sampled generation: its seeded draws follow the
    blocks chosen, so the blocks must not follow timings, or the same seed
    would not give the same tokens) the factors stay 1 until the cycles drift
    past ``DRIFT``: the choices then depend on the curve and the outcomes
    alone, as long as the machine keeps near the curve."""

    def __init__(self, curve: CostCurve, on_drift: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter, window: int = DRIFT_WINDOW,
                 tolerance: float = DRIFT, times: Optional[CycleTimes] = None, weigh: bool = True):
        self.curve = curve
        self.on_drift = on_drift
        self.clock = clock
        self.tolerance = tolerance
        self.times = times or CycleTimes(window)
        self.weigh = weigh
        self.last: Optional[float] = None
        self.drifted = False
        self.factors = (1.0, 1.0)
        self._rescale()

    def cycle_done(self, block_size: int, context: int) -> None:
        now = self.clock()
        if self.last is not None:
            ratios = self.times.of(block_size > 1)
            ratios.append((now - self.last) / self.curve.cycle_seconds(block_size, context))
            if not self.drifted and len(ratios) == ratios.maxlen:
                median = statistics.median(ratios)
                if not 1 / self.tolerance <= median <= self.tolerance:
                    self.drifted = True
                    if self.on_drift:
                        self.on_drift()
            self._rescale()
        self.last = now

    def _rescale(self) -> None:
        step = lambda r: 2 ** (round(math.log2(max(statistics.median(r), 1e-9)) * 8) / 8)  # noqa: E731
        timed = (self.times.of(False), self.times.of(True))
        if not (self.weigh or self.drifted):
            self.factors = (1.0, 1.0)
            return
        plain, speculative = (step(r) if len(r) >= SETTLED else None for r in timed)
        self.factors = (plain or speculative or 1.0, speculative or plain or 1.0)

    def factor(self, block_size: int) -> float:
        return self.factors[block_size > 1]


@dataclass(frozen=True)
class Watched:
    """A given curve each generation watches for drift as it does the measured
    one, with nothing cached to forget (bench's auto runs: priced as a user's)."""

    curve: CostCurve
