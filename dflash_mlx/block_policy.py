"""How many tokens each cycle drafts and verifies.

The decoder asks its policy for b right before drafting the next block and
tells it each cycle's outcome (the block used and the drafts accepted). The
block never changes the output, only the speed: whatever b, the committed
tokens are the target's own (greedy), or distributed as its own sampling.

``FixedBlock`` always answers the same b. ``AdaptiveBlock`` (``block_size=
"auto"``) picks the b that maximises expected committed tokens per second:

    E[tokens | b] = 1 + sum_{i=1}^{b-1} prod_{j<=i} c_j
    rate(b)       = E[tokens | b] / (t_target(b) + t_draft(b))

where c_i is the acceptance probability of draft position i given positions
before it were accepted, an exponential moving average over the cycles that
reached position i (starting from a conservative prior), and the times come
from the pair's measured cost curve (``cost_curve.py``) at the current
context length (attention makes every pass dearer as the context grows). b = 1
is a plain target step with no draft pass (its price includes injecting its
position into the draft's context when the draft next runs).

While b = 1 wins, acceptance is still measured now and then, so speculation
comes back when the text turns predictable: a probe drafts the best b > 1
beside a plain step and, instead of verifying it, judges its drafts against
the target's own next tokens (``probed``): a greedy draft is accepted exactly
where it matches them; a sampled one with the rejection rule's probability
min(1, p/q), as far as the drafts match the tokens drawn. Nothing is
verified or rolled back, so a probe costs one draft pass and the output is
the plain steps'. Probes come every ``probe_every`` plain steps, or less
often when their draft passes would cost more than ``probe_budget`` of the
plain steps' time. Given the curve, the contexts and the outcomes, the
choices are deterministic, unless a ``DriftWatch`` (``cost_curve.py``) finds
the observed cycle times drifted from the curve: from then on the costs are
scaled by what it observes.
"""

import math
from typing import Optional, Protocol

PRIOR_ACCEPTANCE = 0.6  # c_i before any outcome: tau 2.5 at b = 16, below what trained drafts reach
RATE = 0.2  # weight of the newest outcome in each c_i (about the last five cycles count)
PROBE_EVERY = 8  # plain steps between probes of speculation, at the least
PROBE_BUDGET = 0.02  # the most of the plain steps' time the probes' draft passes may take
PRICE_STEP = 64  # costs are read again each time the context crosses a multiple of this


class BlockPolicy(Protocol):
    """A policy that probes (``AdaptiveBlock``) also has ``probe()`` and
    ``probed(hits)``."""

    def choose(self, context: int = 0) -> int:
        """The block size of the next cycle (1: no draft, a plain target step),
        with ``context`` tokens in the target's cache."""

    def update(self, block_size: int, accepted: int) -> None:
        """The outcome of the cycle just verified at ``block_size``."""


class Costs(Protocol):
    def cycle_seconds(self, b: int, context: Optional[int] = None) -> float:
        """Seconds of one cycle at block b with ``context`` tokens cached (the
        draft pass included when b > 1)."""

    def draft(self, b: int, context: Optional[int] = None) -> float:
        """Seconds of the draft pass proposing b-1 tokens."""


class Watch(Protocol):
    def cycle_done(self, block_size: int, context: int) -> None:
        """A cycle at ``block_size`` just ended (the watch keeps the time)."""

    def factor(self, block_size: int) -> float:
        """Observed over predicted seconds at ``block_size``: 1.0 until drift is seen."""


class FixedBlock:
    """The same block every cycle."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def choose(self, context: int = 0) -> int:
        return self.block_size

    def update(self, block_size: int, accepted: int) -> None:
        pass


class AdaptiveBlock:
    """Expected tokens per second from online acceptance and a cost curve."""

    def __init__(self, costs: Costs, max_block: int, prior: float = PRIOR_ACCEPTANCE,
                 rate: float = RATE, probe_every: int = PROBE_EVERY,
                 probe_budget: float = PROBE_BUDGET, watch: Optional[Watch] = None):
        if max_block < 1:
            raise ValueError(f"max_block must be at least 1, got {max_block}")
        self.costs = costs
        self.max_block = max_block
        self.rate = rate
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        self.watch = watch
        self.acceptance = [prior] * (max_block - 1)  # c_1 .. c_{max_block-1}
        self.plain_steps = 0  # cycles at b = 1 since speculation ran or a probe was taken
        self.context = 0  # tokens in the target's cache at the last choice
        self.due = 0  # the block of a probe due beside this plain step, 0: none
        self._prices: tuple = (None, [])  # (what they were read for, seconds at b = 1 .. max_block)

    def cycle_seconds(self, b: int) -> float:
        """The curve's price of a cycle at b at the current context (rounded
        down to a multiple of ``PRICE_STEP``), scaled by the drift the watch
        has seen."""
        return self._seconds()[b - 1]

    def _seconds(self) -> list[float]:
        context = self.context // PRICE_STEP * PRICE_STEP
        factors = (self.watch.factor(1), self.watch.factor(2)) if self.watch else (1.0, 1.0)
        if self._prices[0] != (context, factors):
            seconds = [self.costs.cycle_seconds(b, context) * factors[b > 1] for b in range(1, self.max_block + 1)]
            self._prices = ((context, factors), seconds)
        return self._prices[1]

    def expected_tokens(self, b: int) -> float:
        """E[tokens committed | b]: the target's own token plus each accepted draft."""
        total, reach = 1.0, 1.0
        for c in self.acceptance[: b - 1]:
            reach *= c
            total += reach
        return total

    def tokens_per_second(self, b: int) -> float:
        return self.expected_tokens(b) / self.cycle_seconds(b)

    def rates(self) -> list[float]:
        """tokens_per_second at b = 1 .. max_block, in one pass."""
        seconds, rates, total, reach = self._seconds(), [], 1.0, 1.0
        for b in range(1, self.max_block + 1):
            if b > 1:
                reach *= self.acceptance[b - 2]
                total += reach
            rates.append(total / seconds[b - 1])
        return rates

    def best(self, low: int = 1, rates: Optional[list[float]] = None) -> int:
        """The b in [low, max_block] with the highest rate (the smallest on a tie)."""
        rates = rates or self.rates()
        return max(range(low, self.max_block + 1), key=lambda b: (rates[b - 1], -b))

    def probe_interval(self, probe: int) -> int:
        """Plain steps from one probe at block ``probe`` to the next: at least
        ``probe_every``, and enough that the probe's draft pass costs at most
        ``probe_budget`` of their time."""
        step = self.cycle_seconds(1)
        draft = self.costs.draft(probe, self.context // PRICE_STEP * PRICE_STEP)
        if self.watch:
            draft *= self.watch.factor(probe)
        return max(self.probe_every, math.ceil(draft / (self.probe_budget * step)))

    def choose(self, context: int = 0) -> int:
        self.context = context
        rates = self.rates()
        b = self.best(rates=rates)
        self.due = 0
        if b > 1 or self.max_block == 1:
            self.plain_steps = 0
            return b
        self.plain_steps += 1
        probe = self.best(low=2, rates=rates)
        if self.plain_steps >= self.probe_interval(probe):
            self.due = probe
        return 1

    def probe(self) -> int:
        """After ``choose`` answered 1: the block of the probe to draft beside
        this plain step, judged by ``probed``; 0 while none is due. Taking it
        starts the interval to the next."""
        b, self.due = self.due, 0
        if b:
            self.plain_steps = 0
        return b

    def update(self, block_size: int, accepted: int) -> None:
        if self.watch:
            self.watch.cycle_done(block_size, self.context)
        # positions 1..accepted were accepted; position accepted+1 (if drafted) was rejected
        self._learn(([1.0] * accepted + [0.0])[: block_size - 1])

    def probed(self, hits: list[float]) -> None:
        """A probe's outcome: for each draft position it reached, in order,
        the probability that verifying would have accepted it there."""
        self._learn(hits)

    def _learn(self, hits: list[float]) -> None:
        for i, hit in enumerate(hits[: self.max_block - 1]):
            self.acceptance[i] += self.rate * (hit - self.acceptance[i])
