"""A block drafted beside a plain step (``AdaptiveBlock.probe``), judged
position by position against the target's own next tokens."""

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from .sampling import BlockSampler


@dataclass
class Probe:
    """A block drafted beside a plain step and judged against the target's own
    next tokens instead of verified (``AdaptiveBlock.probe``)."""

    drafted: mx.array  # [b-1] the drafts after the token they were drafted from
    q: Optional[mx.array]  # [b-1, V] the log-probabilities they were drawn from (None: greedy)
    finite: mx.array  # whether the draft's logits were sound
    hits: list = field(default_factory=list)  # per position judged: the probability it would be accepted
    ids: Optional[list[int]] = None  # ``drafted`` read once to the host

    def judge(self, token: int, logits: mx.array, sampler: BlockSampler) -> Optional[list[float]]:
        """Judge the next draft position against the target's own ``token``,
        chosen from processed ``logits`` [1, V]. Once the drafts part from the
        tokens or all are judged: the hits (none for an unsound draft), else None.

        The drafts are read whole, with no new op: slicing one out would queue
        behind the plain step already in flight and wait for it, so the host
        would queue the step after it late (about 1 ms a judged position)."""
        if self.ids is None:
            self.ids = self.drafted.tolist()
        i = len(self.hits)
        drafted = self.ids[i]
        self.hits.append(sampler.acceptance(logits, token, drafted, None if self.q is None else self.q[i]))
        if token == drafted and len(self.hits) < len(self.ids):
            return None
        if not self.finite.item():
            return [0.0] * len(self.hits)
        mx.eval([h for h in self.hits if isinstance(h, mx.array)])
        return [float(h) for h in self.hits]
