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
reached position i (starting from a prior; until an outcome has moved it,
speculation must beat plain steps by ``PRIOR_MARGIN``: the prior is a
guess, and where it promises a few percent a failed cycle costs several
plain steps, while the first probe learns the truth), and the times come
from the pair's measured cost curve (``cost_curve.py``) at the current
context length (attention makes every pass dearer as the context grows). b = 1
is a plain target step with no draft pass (its price includes injecting its
position into the draft's context when the draft next runs).

While b = 1 wins, acceptance is still measured now and then, so speculation
comes back when the text turns predictable: a probe tries the best b > 1,
one of two ways. Verified, it is an ordinary cycle and costs what it takes
beyond the plain steps that would have made its expected tokens; it is
taken only once speculation has run in this generation (the acceptance it
expects then was measured, not the prior) and where it costs less than the
other way. Only drafted, it is drafted beside a plain step and judged
against the target's own next tokens (``probed``): a greedy draft is
accepted exactly where it matches them; a sampled one with the rejection
rule's probability min(1, p/q), as far as the drafts match the tokens drawn.
Nothing is verified or rolled back, so it costs one draft pass and the
output is the plain steps' (the cheaper kind where acceptance is low or the
context long). Probes come ``probe_every`` plain steps apart, then twice
that after a probe that did not bring speculation back, four times after
two, and so on up to the spacing at which their loss is ``probe_budget`` of
the plain steps' time, so text that turns predictable again is found soon
and probes that keep finding nothing cost the budget. Before any has found
nothing, a dear probe still waits until its loss is ``PROBE_FIRST_BUDGET``
(6%) of the plain steps before it: at a long context a draft pass costs one
or two plain steps, and the first probes, 8 steps apart, took 3-4% of a
96-token generation. A probe waits while fewer
than its block plus ``probe_every`` tokens are left to generate (when the
caller says how many): speculation after it would have too few tokens to
repay it; and while it would lose more than ``PROBE_SHARE`` (2%) of the time
of the plain steps left, so that a probe that finds nothing leaves the run
within 2% of plain decoding (the demo draft's pass costs about a plain step
on a CPU: no probe in a 40-token generation, where one took 3%, while a
96-token one still probes, 17 steps in; a real pair's draft is a tenth of its
target, and its probes wait for the block plus 8 tokens alone).
Speculation on the prior alone is a guess of the same kind and waits for
its block plus ``probe_every`` tokens alike: a draft's first blocks are
often far below the prior (on the demo pair, two failed blocks of 8 cost
most of a 12-token generation), so a short generation runs plain. After
k probes that did not bring speculation back the next waits ``probe_every``
x 2^k plain steps (never longer than the budget's spacing); k goes back to 0
only when a speculative cycle pays for itself (its tokens worth more plain
steps than it took), not when speculation merely runs again, so that drafts
that keep failing cannot start a probe every ``probe_every`` steps. A
probe within the first ``probe_warmup`` (16) generated tokens does not count
in k (on the demo pair's held-out prompts, a probe 11 tokens in found
nothing on two prompts whose drafts were right from the 15th token on, and
the backoff after it kept them plain for 44 and 54 tokens). The
first comes ``probe_every`` plain steps in, so a pair whose curve alone says
"plain" learns soon whether its drafts would pay, from positions past the
prompt's end. A draft's first blocks after a prompt are often wrong where
later ones are right (on the demo pair's held-out prompts at b = 8: 1.1
drafts accepted per cycle in the first 8 generated tokens, 2.3 in the next
8, about 4 from the 32nd on), which is also why speculation on the prior
alone must promise ``PRIOR_MARGIN`` (50%) over plain steps: a curve that
prices a cycle at 2.5 plain steps would otherwise start each generation on
cycles that fail, and the backoff of the probes after them keeps it plain
where the text turns predictable. A probe's
outcome, either kind, weighs ``PROBE_RATE`` in each c_i it reached, more
than a speculative cycle's ``RATE``.

A block accepted whole says nothing of the positions past it, so it moves
those c_i back toward the prior by ``UNREACHED_RATE``. Without that, a c_i
that failing cycles pulled down stayed down while the shorter blocks it
chose were accepted whole and never reached it: on one of the demo pair's
held-out prompts the block fell to 2 and stayed there for the last 40
cycles of the reply (173 tokens/s, replayed on its recorded acceptance,
against 267 at a fixed b = 8; 266 with the drift back).

Given the curve, the contexts and the outcomes, the choices are
deterministic, unless a ``DriftWatch`` (``drift_watch.py``) scales the costs
by the cycle times observed: a greedy generation's by those this process
timed on the curve, any non-sampled one's once its own drifted from it.
"""

import math
from typing import Optional, Protocol

PRIOR_ACCEPTANCE = 0.75  # c_i before any outcome: tau 4 at b = 16, below what trained drafts reach (5-7)
RATE = 0.2  # weight of the newest outcome in each c_i (about the last five cycles count)
PROBE_EVERY = 8  # plain steps between probes of speculation, at the least
PROBE_BUDGET = 0.01  # the most of the plain steps' time the probes' draft passes may take
PROBE_BACKOFF_BUDGET = 0.03  # after a probe found nothing, the next one's loss is at most this of the steps between
PROBE_FIRST_BUDGET = 0.06  # before any has, a probe's loss is at most this of the steps between
PROBE_SHARE = 0.02  # the most of the time of the plain steps left to generate that one probe may take
PRIOR_MARGIN = 0.5  # on the prior alone, speculation must beat plain steps by this share
PROBE_RATE = 0.5  # weight of a probe's outcome in each c_i it reached: probes are rare, each counts more
PROBE_WARMUP = 16  # generated tokens during which a probe that finds nothing does not back the next one off
PRICE_STEP = 64  # costs are read again each time the context crosses a multiple of this
UNREACHED_RATE = 0.2  # how far a block accepted whole moves the positions past it back toward the prior


class BlockPolicy(Protocol):
    """A policy that probes (``AdaptiveBlock``) also has ``probe()`` and
    ``probed(block_size, hits)``."""

    def choose(self, context: int = 0, left: Optional[int] = None) -> int:
        """The block size of the next cycle (1: no draft, a plain target step),
        with ``context`` tokens in the target's cache and ``left`` tokens
        still to generate (None: unknown). The decoder caps b at ``left``."""

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

    def choose(self, context: int = 0, left: Optional[int] = None) -> int:
        return self.block_size

    def update(self, block_size: int, accepted: int) -> None:
        pass


class AdaptiveBlock:
    """Expected tokens per second from online acceptance and a cost curve."""

    def __init__(self, costs: Costs, max_block: int, prior: float = PRIOR_ACCEPTANCE,
                 rate: float = RATE, probe_every: int = PROBE_EVERY,
                 probe_budget: float = PROBE_BUDGET, watch: Optional[Watch] = None,
                 probe_warmup: int = PROBE_WARMUP):
        if max_block < 1:
            raise ValueError(f"max_block must be at least 1, got {max_block}")
        self.costs = costs
        self.max_block = max_block
        self.rate = rate
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        self.probe_warmup = probe_warmup
        self.watch = watch
        self.prior = prior
        self.acceptance = [prior] * (max_block - 1)  # c_1 .. c_{max_block-1}
        self.plain_steps = 0  # cycles at b = 1 since speculation ran or a probe was taken
        self.context = 0  # tokens in the target's cache at the last choice
        self.start: Optional[int] = None  # ... at the first: where generation started
        self.due = 0  # the block of a probe due beside this plain step, 0: none
        self.verifying_probe = False  # the block chosen last is a probe, verified
        self.speculated = False  # whether speculation has run (a verified probe may be taken)
        self.learned = False  # whether any outcome has moved the acceptance off the prior
        self.failed_probes = 0  # probes since a speculative cycle last paid for itself
        self._prices: tuple = (None, [])  # (what they were read for, seconds at b = 1 .. max_block)

    def reprice(self) -> None:
        """Read the prices from the costs again (they changed: a batch's width)."""
        self._prices = (None, [])

    def cycle_seconds(self, b: int) -> float:
        """The curve's price of a cycle at b at the current context (rounded
        down to a multiple of ``PRICE_STEP``), scaled by the drift the watch
        has seen."""
        return self._seconds()[b - 1]

    def _priced_context(self) -> int:
        return self.context // PRICE_STEP * PRICE_STEP

    def _seconds(self) -> list[float]:
        context = self._priced_context()
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

    def verified_probe_loss(self, probe: int) -> float:
        """Seconds a probe verified at block ``probe`` takes beyond the plain
        steps that would make its expected tokens."""
        return self.cycle_seconds(probe) - self.expected_tokens(probe) * self.cycle_seconds(1)

    def drafted_probe_loss(self, probe: int) -> float:
        """Seconds a probe only drafted at block ``probe`` takes: its draft pass."""
        draft = self.costs.draft(probe, self._priced_context())
        return draft * (self.watch.factor(probe) if self.watch else 1.0)

    def probe_loss(self, probe: int) -> float:
        """Seconds a probe at block ``probe`` loses, the cheaper way it may be taken."""
        loss = self.drafted_probe_loss(probe)
        return min(loss, self.verified_probe_loss(probe)) if self.speculated else loss

    def probe_interval(self, probe: int) -> int:
        """Plain steps before a probe at block ``probe``: ``probe_every`` x 2^k
        after k probes that found nothing since a speculative cycle last paid
        for itself, and then at least as many as make the probe's loss
        ``PROBE_BACKOFF_BUDGET`` of their time (``PROBE_FIRST_BUDGET`` while
        none has found nothing: a dear probe, at a long context, waits
        longer); at most the spacing at which its loss is ``probe_budget`` of
        their time, and at least ``probe_every``."""
        loss = self.probe_loss(probe) / self.cycle_seconds(1)  # in plain steps
        budget = PROBE_BACKOFF_BUDGET if self.failed_probes else PROBE_FIRST_BUDGET
        backoff = max(self.probe_every * 2**self.failed_probes, math.ceil(loss / budget))
        return max(self.probe_every, min(math.ceil(loss / self.probe_budget), backoff))

    def choose(self, context: int = 0, left: Optional[int] = None) -> int:
        self.context = context
        self.start = context if self.start is None else self.start
        rates = self.rates()
        if not self.learned:  # a guess: speculate only where it promises a margin
            rates[0] *= 1 + PRIOR_MARGIN
        b = self.best(rates=rates)
        self.due, self.verifying_probe = 0, False
        if b > 1 and not self.learned and self._too_few(b, left):
            b = 1  # a guess on the prior with no room to recover if it is wrong
        if b > 1 or self.max_block == 1:
            self.plain_steps = 0
            self.speculated = True
            return b
        probe = self.best(low=2, rates=rates)
        self.plain_steps += 1
        if self.plain_steps < self.probe_interval(probe):
            return 1
        if self._too_few(probe, left) or self._too_dear(probe, left):
            return 1  # too few tokens left to repay it, or too dear a share of them: it stays due
        self.plain_steps = 0  # a probe is due
        if self.speculated and self.verified_probe_loss(probe) <= self.drafted_probe_loss(probe):
            self.verifying_probe = True  # the tokens it makes pay for more than a draft pass alone
            return probe
        self.due = probe
        return 1

    def _too_few(self, block: int, left: Optional[int]) -> bool:
        """Whether fewer than ``block`` + ``probe_every`` tokens are left to generate."""
        return left is not None and left < block + self.probe_every

    def _too_dear(self, probe: int, left: Optional[int]) -> bool:
        """Whether the probe would lose more than ``PROBE_SHARE`` of the time
        of the plain steps left to generate."""
        return left is not None and self.probe_loss(probe) > PROBE_SHARE * left * self.cycle_seconds(1)

    def probe(self) -> int:
        """After ``choose`` answered 1: the block of a probe to draft beside
        this plain step and judge by ``probed``, or 0 while none is due."""
        b, self.due = self.due, 0
        return b

    def update(self, block_size: int, accepted: int) -> None:
        if self.watch:
            self.watch.cycle_done(block_size, self.context)
        # positions 1..accepted were accepted; position accepted+1 (if drafted) was rejected
        hits = ([1.0] * accepted + [0.0])[: block_size - 1]
        if self.verifying_probe:
            self.probed(block_size, hits)
        else:
            self._learn(hits, self.rate)
        self._count_paid(block_size, [accepted])

    def update_rows(self, block_size: int, accepted: list[int]) -> None:
        """A batch cycle's outcomes, one per row (``loop/batch.py``): each
        learned as a cycle of its own, except that a verified probe counts
        once, its hits the rows' shares (``shared_hits``); the watch times the
        batch's cycle once."""
        if self.watch:
            self.watch.cycle_done(block_size, self.context)
        hits = [([1.0] * a + [0.0])[: block_size - 1] for a in accepted]
        if self.verifying_probe:
            self.probed(block_size, shared_hits(hits))
        else:
            for row in hits:
                self._learn(row, self.rate)
        self._count_paid(block_size, accepted)

    def _count_paid(self, block_size: int, accepted: list[int]) -> None:
        """Probes come close again once a speculative cycle paid for itself
        (a row's tokens worth more plain steps than the cycle took)."""
        if block_size > 1 and any((a + 1) * self.cycle_seconds(1) >= self.cycle_seconds(block_size) for a in accepted):
            self.failed_probes = 0

    def probed(self, block_size: int, hits: list[float]) -> None:
        """A probe's outcome at ``block_size``: for each draft position it
        reached, in order, the probability that verifying would have accepted
        it there. It counts as a probe that found nothing until a speculative
        cycle pays for itself, unless it came within the first
        ``probe_warmup`` generated tokens, where a draft's blocks are often
        wrong that later ones are right."""
        self._learn(hits, PROBE_RATE)
        if self.context - (self.start or 0) >= self.probe_warmup:
            self.failed_probes += 1

    def _learn(self, hits: list[float], rate: float) -> None:
        """Each position an outcome reached moves toward its hit; where every
        position it reached was a hit (a block accepted whole), each position
        past it moves back toward the prior by ``UNREACHED_RATE``: an estimate
        that failed cycles once pulled down would otherwise stay there while
        the blocks they made too short keep being accepted whole (see the
        module's docstring). Past a rejection nothing moves: on text the
        draft cannot predict, that would bring speculation back without a probe."""
        if not hits:
            return
        self.learned = True
        for i, hit in enumerate(hits[: self.max_block - 1]):
            self.acceptance[i] += rate * (hit - self.acceptance[i])
        if all(hit == 1.0 for hit in hits):
            for i in range(len(hits), self.max_block - 1):
                self.acceptance[i] += UNREACHED_RATE * (self.prior - self.acceptance[i])


class ConfidenceSchedule:
    """How many of a DSpark block's drafts to verify, from its confidences
    (docs/dspark.md, "Confidence-scheduled verification").

    With a_i = c_1 ... c_i the chance drafts 1..i are all accepted, verifying
    l drafts commits 1 + a_1 + ... + a_l tokens in expectation, in the cycle's
    time: the draft pass (the trained block, whatever l) plus the target's
    pass over l + 1 tokens. From l = 1, one more draft is taken while that does
    not lower the rate. Stopping at the first drop keeps the output the
    target's: whether draft l + 1 is verified depends on c_{l+1}, which reads
    drafts 1..l only, never on draft l + 1 itself (a search over every l would
    look at later drafts, and bias which ones get verified)."""

    def __init__(self, costs: "CurveCosts"):
        self.costs = costs

    def cut(self, drafted, q, confidences, trained: int, context: int = 0):
        """(drafted, q) cut to ``length`` (waits for the confidences [n]; None: uncut)."""
        if confidences is None:
            return drafted, q
        n = self.length(confidences.tolist(), trained, context)
        return drafted[:n], None if q is None else q[:n]

    def length(self, confidences: list[float], trained: int, context: int = 0) -> int:
        """Drafts to verify (1 .. len(confidences)) out of a block of ``trained`` drafts."""
        draft = self.costs.draft(trained + 1, context)
        rate = lambda tokens, n: tokens / (draft + self.costs.target(n + 1, context))
        reach = confidences[0]
        tokens, n = 1.0 + reach, 1
        for c in confidences[1:]:
            reach *= c
            if rate(tokens + reach, n + 1) < rate(tokens, n):
                break
            tokens, n = tokens + reach, n + 1
        return n


class CurveCosts(Costs, Protocol):
    def target(self, b: int, context: Optional[int] = None) -> float:
        """Seconds of the target's pass over b tokens."""


def shared_hits(rows: list[list[float]]) -> list[float]:
    """One outcome from several rows' hits (per draft position each row
    reached, the probability it was accepted there): per position, the mean
    over the rows that reached it."""
    hits = []
    for i in range(max(map(len, rows), default=0)):
        reached = [row[i] for row in rows if len(row) > i]
        hits.append(sum(reached) / len(reached))
    return hits
