"""The batch's block size: one b per cycle for all rows (``loop/batch.py``).

``BatchBlock`` is ``AdaptiveBlock`` over the batch: it learns one acceptance
curve from every row's outcomes (the batch verifies one b for all of them, so
what decides b is the rows' mean expected tokens) and prices a cycle per row:
the seconds of a pass over B rows of b tokens, over B. Those come from the
pair's cost curve (one row) times the batch's measured width factor
(``BatchCosts``: the passes timed at widths 1, 2, 4 and 8 on this machine).
As rows are added a speculative cycle costs more per row only as far as the
passes stop being bound by reading the weights, so drafting pays less at
larger widths and the policy falls back to plain batched steps (b = 1) where
it does not pay. With one row it is ``AdaptiveBlock`` on the same curve.
"""

import time
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import cost_curve as costs
from .block_policy import AdaptiveBlock, shared_hits
from .drift_watch import DriftWatch, times_for
from ..targets import RowKVCache

WIDTHS = (1, 2, 4, 8)  # batch widths timed; wider batches use the widest factor
SIZES = (1, 2, 4, 8, 16)  # block sizes timed (those up to the draft's trained size)
CONTEXT = 64  # tokens each row holds while timing
ROUNDS = 5  # passes of every width and size, interleaved; each factor is from their medians
METHOD = 2  # in the cache key: 2, interleaved medians shaped as a batch's cost can be (``shaped``)


@dataclass(frozen=True)
class BatchCosts:
    """Seconds of a batch cycle relative to B one-row cycles of the same b:
    ``factor[w][s]`` at ``WIDTHS[w]``, size ``sizes[s]``, measured."""

    sizes: tuple[int, ...]
    factors: tuple[tuple[float, ...], ...]  # per width in WIDTHS, per size

    def __post_init__(self):
        ok = (len(self.sizes) >= 1 and len(self.factors) == len(WIDTHS)
              and all(len(row) == len(self.sizes) for row in self.factors)
              and all(isinstance(f, (int, float)) and 0 < f < float("inf") for row in self.factors for f in row))
        if not ok:
            raise ValueError(f"not batch costs: {self}")

    def to_dict(self) -> dict:
        return {"widths": list(WIDTHS), "sizes": list(self.sizes), "factors": [list(row) for row in self.factors]}

    @classmethod
    def from_dict(cls, d: dict) -> "BatchCosts":
        if d["widths"] != list(WIDTHS):
            raise ValueError("other widths")
        return cls(tuple(d["sizes"]), tuple(tuple(row) for row in d["factors"]))

    def factor(self, width: int, b: int) -> float:
        """The width's factor at b (the nearest widths and sizes measured, linear between sizes)."""
        w = max(i for i, x in enumerate(WIDTHS) if x <= max(width, 1))
        row, sizes = self.factors[w], self.sizes
        if b <= sizes[0]:
            return row[0]
        for (b0, f0), (b1, f1) in zip(zip(sizes, row), zip(sizes[1:], row[1:])):
            if b <= b1:
                return f0 + (f1 - f0) * (b - b0) / (b1 - b0)
        return row[-1]


class WidthCosts:
    """A cost curve priced per row of a batch of ``width`` rows."""

    def __init__(self, curve, batch: BatchCosts, width: int = 1):
        self.curve, self.batch, self.width = curve, batch, width

    def cycle_seconds(self, b: int, context: Optional[int] = None) -> float:
        return self.curve.cycle_seconds(b, context) * self.batch.factor(self.width, b)

    def draft(self, b: int, context: Optional[int] = None) -> float:
        return self.curve.draft(b, context) * self.batch.factor(self.width, b)


@dataclass(frozen=True)
class BatchCycles:
    """A whole batch cycle's seconds at ``width`` rows, as priced: what a
    ``DriftWatch`` times a batch's cycles against (and the key of their times)."""

    curve: costs.CostCurve
    batch: BatchCosts
    width: int

    def cycle_seconds(self, b: int, context: Optional[int] = None) -> float:
        return self.curve.cycle_seconds(b, context) * self.batch.factor(self.width, b) * self.width


class FixedRows:
    """The same b for every cycle."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def choose(self, rows: list) -> int:
        return self.block_size

    def update(self, rows: list, block_size: int, accepted: list[int]) -> None:
        pass


class BatchBlock:
    """``AdaptiveBlock`` for a batch: one acceptance curve learned from every
    row, cycles priced per row at the batch's width. A probe is drafted for
    every row beside a plain batched step and judged per row against the
    row's own next tokens, as a request alone judges it; the rows' hits make
    one outcome.

    ``timed``: while every row is greedy, the batch's cycles are weighed at
    the cost this process observed for them at its width, as a greedy request
    alone weighs its own (``drift_watch.py``; the width factors are timed pass
    by pass in a few seconds and priced the demo pair's drafted cycles at 8 rows
    below what they cost, so the batch drafted where plain batched steps were
    faster). A batch with a sampled row is priced by the curve and factors
    alone: its seeded draws follow the blocks."""

    def __init__(self, curve, batch: BatchCosts, max_block: int, timed: bool = False):
        self.costs = WidthCosts(curve, batch)
        self.block = AdaptiveBlock(self.costs, max_block)
        self.timed = timed
        self.greedy: Optional[bool] = None  # whether the batch was weighed as greedy at the last choice

    def choose(self, rows: list) -> int:
        greedy = self.timed and all(row.sampler.greedy for row in rows)
        if len(rows) != self.costs.width or greedy != self.greedy:
            self.costs.width, self.greedy = len(rows), greedy
            self.block.reprice()
            if self.timed:
                cycles = BatchCycles(self.costs.curve, self.costs.batch, self.costs.width)
                self.block.watch = DriftWatch(cycles, times=times_for(cycles)) if greedy else None
        left = [r.tokens_left() for r in rows]
        return self.block.choose(max(len(r.tokens) for r in rows), None if None in left else max(left))

    def probe(self) -> int:
        """After ``choose`` answered 1: the block of a probe to draft beside this plain step, or 0."""
        return self.block.probe()

    def probed(self, block_size: int, rows: list[list[float]]) -> None:
        """A probe's outcome: each row's hits (``Probe.judge``)."""
        self.block.probed(block_size, shared_hits(rows))

    def update(self, rows: list, block_size: int, accepted: list[int]) -> None:
        self.block.update_rows(block_size, accepted)


def shaped(factors: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    """Measured factors (per width in WIDTHS, per size) held to the shape a
    batch's cost has, wherever the timings' noise broke it: a width's factor
    never falls as b grows (the wider pass leaves the weight-bound regime
    first; fitted by pooling adjacent violators), never rises with the width
    (B rows cost at most two passes of B / 2), and never goes below 1 / B (a
    pass over B rows costs at least one over a single row). Timed pass by
    pass, single factors moved by a third between measurements a minute
    apart; one that priced blocks of 16 at 2 rows below blocks of 8 sent the
    demo pair's batches of two to b = 16, their slowest block."""
    rows = []
    for width, row in zip(WIDTHS, factors):
        pools = []  # [mean, count] of adjacent sizes pooled
        for f in row:
            pools.append([f, 1])
            while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
                (a, n), (b, m) = pools.pop(-2), pools.pop()
                pools.append([(a * n + b * m) / (n + m), n + m])
        row = [mean for mean, count in pools for _ in range(count)]
        if rows:
            row = [min(f, narrower) for f, narrower in zip(row, rows[-1])]
        rows.append([max(f, 1 / width) for f in row])
    return tuple(tuple(row) for row in rows)


def measure(target, draft, sizes: tuple[int, ...]) -> BatchCosts:
    """Time the target's verify pass with its logits and the draft's pass over
    [B, b] at every width and size, with ``CONTEXT`` tokens in each row's
    caches, ``ROUNDS`` times in turn; a width's factor is its median time over
    B times the one-row median, ``shaped``."""
    layer_ids = draft.config.target_layer_ids

    def setup(width: int) -> tuple[list, list]:
        rows = lambda c: RowKVCache(lengths=[0] * width) if isinstance(c, KVCache) else c
        cache = [rows(c) for c in target.make_cache()]
        context = [RowKVCache(lengths=[0] * width) for _ in draft.layers]
        out = target.forward(mx.zeros((width, CONTEXT), dtype=mx.int32), cache, layer_ids)
        draft.inject(out.features, context)
        mx.eval([c.state for c in cache + context])
        return cache, context

    def seconds(width: int, b: int, cache: list, context: list) -> float:
        block = mx.ones((width, b), dtype=mx.int32)
        tic = time.perf_counter()
        out = target.forward(block, cache, layer_ids, record=b > 1)
        work = [target.logits(out.hidden), out.features]
        if b > 1:
            work.append(draft(target.embed(block), context))
        mx.eval(work)
        elapsed = time.perf_counter() - tic
        for c in cache:
            if isinstance(c, RowKVCache):
                c.trim(b)  # recurrent states only move on: their size does not grow
        return elapsed

    caches = {width: setup(width) for width in WIDTHS}
    times = {(width, b): [] for width in WIDTHS for b in sizes}
    for width, b in times:  # untimed: each shape's first pass allocates its buffers
        seconds(width, b, *caches[width])
    for _ in range(ROUNDS):
        for width, b in times:
            times[(width, b)].append(seconds(width, b, *caches[width]))
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    factors = [[median[(width, b)] / (width * median[(1, b)]) for b in sizes] for width in WIDTHS]
    return BatchCosts(sizes, shaped(factors))


def batch_costs(target, draft, directory=None) -> BatchCosts:
    """The pair's batch factors on this machine: cached beside its cost curve
    (same key, plus the widths), else measured (a few seconds) and cached."""
    key = {**costs.cache_key(target, draft), "widths": list(WIDTHS), "method": METHOD}
    path = costs.cache_path(key, directory, "batch-costs")
    found = costs.read_cached(path, key, BatchCosts)
    if found is None:
        found = measure(target, draft, tuple(s for s in SIZES if s <= draft.config.block_size))
        costs.write_cached(path, key, found)
    return found


def batch_policy(target, draft, block_size: Union[int, str, None]):
    """The policy of ``block_size``: a fixed b (None: the draft's trained size),
    or ``"auto"``: ``BatchBlock`` on the pair's cost curve and its batch factors, timed."""
    if block_size is None:
        return FixedRows(draft.config.block_size)
    if isinstance(block_size, int):
        return FixedRows(block_size)
    return BatchBlock(costs.cost_curve(target, draft), batch_costs(target, draft), draft.config.block_size, timed=True)
