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
from the pair's measured cost curve (``cost_curve.py``). b = 1 is a plain
target step with no draft pass; while it wins, every ``probe_every``-th cycle
tries the best b > 1 instead, so acceptance is measured again and speculation
comes back when the text turns predictable. Given the curve and the outcomes,
the choices are deterministic.
"""

from typing import Protocol

PRIOR_ACCEPTANCE = 0.6  # c_i before any outcome: tau 2.5 at b = 16, below what trained drafts reach
RATE = 0.2  # weight of the newest outcome in each c_i (about the last five cycles count)
PROBE_EVERY = 8  # plain steps between probes of speculation


class BlockPolicy(Protocol):
    def choose(self) -> int:
        """The block size of the next cycle (1: no draft, a plain target step)."""

    def update(self, block_size: int, accepted: int) -> None:
        """The outcome of the cycle just verified at ``block_size``."""


class Costs(Protocol):
    def cycle_seconds(self, b: int) -> float:
        """Seconds of one cycle at block b (the draft pass included when b > 1)."""


class FixedBlock:
    """The same block every cycle."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def choose(self) -> int:
        return self.block_size

    def update(self, block_size: int, accepted: int) -> None:
        pass


class AdaptiveBlock:
    """Expected tokens per second from online acceptance and a cost curve."""

    def __init__(self, costs: Costs, max_block: int, prior: float = PRIOR_ACCEPTANCE,
                 rate: float = RATE, probe_every: int = PROBE_EVERY):
        if max_block < 1:
            raise ValueError(f"max_block must be at least 1, got {max_block}")
        self.costs = costs
        self.max_block = max_block
        self.rate = rate
        self.probe_every = probe_every
        self.acceptance = [prior] * (max_block - 1)  # c_1 .. c_{max_block-1}
        self.plain_steps = 0  # cycles at b = 1 since speculation last ran

    def expected_tokens(self, b: int) -> float:
        """E[tokens committed | b]: the target's own token plus each accepted draft."""
        total, reach = 1.0, 1.0
        for c in self.acceptance[: b - 1]:
            reach *= c
            total += reach
        return total

    def tokens_per_second(self, b: int) -> float:
        return self.expected_tokens(b) / self.costs.cycle_seconds(b)

    def best(self, low: int = 1) -> int:
        """The b in [low, max_block] with the highest rate (the smallest on a tie)."""
        sizes = range(low, self.max_block + 1)
        return max(sizes, key=lambda b: (self.tokens_per_second(b), -b))

    def choose(self) -> int:
        b = self.best()
        if b > 1 or self.max_block == 1:
            self.plain_steps = 0
            return b
        self.plain_steps += 1
        if self.plain_steps < self.probe_every:
            return 1
        self.plain_steps = 0
        return self.best(low=2)

    def update(self, block_size: int, accepted: int) -> None:
        # positions 1..accepted were accepted; position accepted+1 (if drafted) was rejected
        for i in range(1, min(accepted + 1, block_size - 1) + 1):
            hit = 1.0 if i <= accepted else 0.0
            self.acceptance[i - 1] += self.rate * (hit - self.acceptance[i - 1])
