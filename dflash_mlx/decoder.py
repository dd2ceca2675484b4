"""The lossless block speculative loop (DESIGN.md §2), one cycle at a time.

``SpeculativeDecoder`` owns the target cache. Each ``cycle()`` asks a proposer
for b-1 tokens after the pending token y, verifies [y, d_1..d_{b-1}] in one
target pass, keeps the longest prefix that matches the target's own greedy
choices plus the target's bonus token, rolls the cache back exactly and hands
the accepted positions' features to the proposer. The host reads one small
result per cycle.
"""

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from .draft import DFlashDraft
from .target import Target
from .verify import greedy_verify


class Proposer(Protocol):
    """Anything that proposes block tokens: the DFlash draft, or a test oracle."""

    def observe(self, features: mx.array) -> None:
        """Features [1, T, k*H] of the next T committed positions."""

    def propose(self, y: mx.array, block_size: int) -> mx.array:
        """b-1 proposed tokens (int32 [b-1]) following token y ([1])."""


class DraftProposer:
    """Proposes with a DFlash draft that borrows the target's embedding and head."""

    def __init__(self, draft: DFlashDraft, target: Target):
        self.draft = draft
        self.target = target
        self.cache = draft.make_cache()
        self.mask_token_id = draft.config.mask_token_id

    def observe(self, features: mx.array) -> None:
        self.draft.inject(features, self.cache)

    def propose(self, y: mx.array, block_size: int) -> mx.array:
        masks = mx.full((block_size - 1,), self.mask_token_id, dtype=y.dtype)
        block = mx.concatenate([y, masks])[None]
        hidden = self.draft(self.target.embed(block), self.cache)
        logits = self.target.logits(hidden[:, 1:])
        return mx.argmax(logits[0], axis=-1).astype(y.dtype)


@dataclass
class Cycle:
    tokens: list[int]  # committed this cycle: accepted drafts, then the target's token
    accepted: int  # how many drafted tokens were accepted


class SpeculativeDecoder:
    """Prefill, then verify-and-commit cycles over one target cache."""

    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        layer_ids: list[int],
        block_size: int,
        prefill_step_size: int = 2048,
    ):
        self.target = target
        self.proposer = proposer
        self.layer_ids = layer_ids
        self.block_size = block_size
        self.prefill_step_size = prefill_step_size
        self.cache = target.make_cache()
        self.pending: mx.array | None = None  # y: chosen but not yet fed to the target
        self.drafted: mx.array | None = None  # the proposal after y, already queued

    def prefill(self, prompt: mx.array) -> int:
        """Feed the prompt in chunks; return the first generated token."""
        for start in range(0, prompt.size, self.prefill_step_size):
            chunk = prompt[start : start + self.prefill_step_size][None]
            out = self.target.forward(chunk, self.cache, self.layer_ids)
            self.proposer.observe(out.features)
            mx.eval([c.state for c in self.cache], out.hidden)
            mx.clear_cache()
        logits = self.target.logits(out.hidden[:, -1])
        self.pending = mx.argmax(logits, axis=-1).astype(mx.int32)
        first = self.pending.item()
        self._queue_draft()
        return first

    def _queue_draft(self) -> None:
        # start drafting the next block while the host streams this cycle's text
        self.drafted = self.proposer.propose(self.pending, self.block_size)
        mx.async_eval(self.drafted)

    def cycle(self) -> Cycle:
        """One draft + verify + commit cycle; returns the committed tokens."""
        y, drafted = self.pending, self.drafted
        block = mx.concatenate([y, drafted])[None]
        out = self.target.forward(block, self.cache, self.layer_ids, record=True)
        accepted, next_token = greedy_verify(self.target.logits(out.hidden), drafted[None])
        mx.eval(accepted, next_token, drafted)  # the one sync of the cycle
        a = accepted.item()
        tokens = drafted[:a].tolist() + [next_token.item()]
        self.target.rollback(self.cache, out, a + 1)
        self.proposer.observe(out.features[:, : a + 1])
        self.pending = next_token
        self._queue_draft()
        return Cycle(tokens, a)
