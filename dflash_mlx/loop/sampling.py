"""Sampling for the block loop: one warping for target (p) and draft (q),
logits processors applied exactly as autoregressive decoding would, and the
per-cycle choices (draft tokens, verification, first token).

Warping follows mlx-lm's ``make_sampler`` so that "the target's distribution"
means what it means in mlx-lm: top-p, then min-p, then top-k on the untempered
log-probabilities, then the temperature.
"""

import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from .. import validate
from ..errors import DFlashError
from ..structured import Constraint
from .verify import greedy_verify, sampled_verify


@dataclass
class SamplingParams:
    """What the user asked for; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    logit_bias: Optional[dict[int, float]] = field(default=None)
    logits_processors: Optional[list[Callable]] = None  # the caller's mlx-lm ones, after the above

    def validate(self) -> None:
        """One-line DFlashError for a value out of range (the rules of
        ``validate.RULES``) or logits processors that are not a list of functions."""
        validate.options({k: v for k, v in vars(self).items() if k in validate.RULES})
        extra = self.logits_processors
        if extra is not None and not (isinstance(extra, (list, tuple)) and all(map(callable, extra))):
            raise DFlashError("logits_processors must be a list of functions (tokens, logits) -> logits, "
                              f"as mlx-lm's, got {extra!r}")

    @property
    def context_size(self) -> int:
        """How many trailing tokens the logits processors can look at: all
        of them for the caller's, which mlx-lm hands the whole history."""
        if self.logits_processors:
            return sys.maxsize
        sizes = [
            (self.repetition_penalty, self.repetition_context_size),
            (self.presence_penalty, self.presence_context_size),
            (self.frequency_penalty, self.frequency_context_size),
        ]
        return max([n for penalty, n in sizes if penalty] or [0])


def log_probs(logits: mx.array) -> mx.array:
    """The target's log-probabilities of processed logits [n, V] (before the
    sampler's warping), as mlx-lm's ``generate_step`` reports them."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def warp(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalized log-probabilities [..., V] after top-p, min-p, top-k and temperature."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    logprobs = logprobs * (1.0 / params.temperature)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


class BlockSampler:
    """Turns logits into tokens for prefill, drafting and verification."""

    def __init__(self, params: SamplingParams, constraint: Optional[Constraint] = None):
        params.validate()
        self.params = params
        self.constraint = constraint  # a grammar the output follows (structured.py), or None
        self.greedy = params.temperature == 0
        self.processors = make_logits_processors(
            params.logit_bias,
            params.repetition_penalty,
            params.repetition_context_size,
            params.presence_penalty,
            params.presence_context_size,
            params.frequency_penalty,
            params.frequency_context_size,
        ) + list(params.logits_processors or [])
        seed = params.seed if params.seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item())
        self.key = mx.random.key(seed)

    def _next_key(self) -> mx.array:
        self.key, key = mx.random.split(self.key)
        return key

    def draft_key(self) -> Optional[mx.array]:
        """The key of the next block's draws, for a proposer that draws its own
        drafts (None when greedy)."""
        return None if self.greedy else self._next_key()

    @property
    def argmax_only(self) -> bool:
        """Whether every choice is the argmax of the raw logits (greedy, no
        processors, no grammar), so a batch may choose for such rows at once."""
        return self.greedy and not self.sees_history

    @property
    def sees_history(self) -> bool:
        """Whether ``process`` reads the history (logits processors or a constraint)."""
        return bool(self.processors) or self.constraint is not None

    def process(self, logits: mx.array, history: mx.array, drafted: Optional[int] = None) -> mx.array:
        """Apply the logits processors to rows [n, V], where row i follows
        ``history[: len(history) - n + 1 + i]``, just as decoding one token at a
        time would have seen it. A constraint masks the rows last: the
        history's last ``drafted`` tokens (default n-1, a chain's block) are
        drafts, not yet committed."""
        n = logits.shape[0]
        if self.processors:
            rows = []
            for i in range(n):
                row = logits[i : i + 1]
                seen = history[: history.size - n + 1 + i]
                for processor in self.processors:
                    row = processor(seen, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        if self.constraint is not None:
            drafted = n - 1 if drafted is None else drafted
            logits = self.constraint.restrict(logits, history[history.size - drafted :].tolist())
        return logits

    def commit(self, tokens: mx.array) -> None:
        """Tell the constraint (if any) the tokens the loop chose, in order."""
        if self.constraint is not None:
            self.constraint.commit(tokens)

    def next_token(self, logits: mx.array) -> mx.array:
        """The target's token after each row of logits [n, V] (a prompt, a plain
        step): int32 [n], its argmax or a draw from its warped distribution."""
        if self.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        return mx.random.categorical(warp(logits, self.params), key=self._next_key()).astype(mx.int32)

    def draft(self, logits: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """Drafted tokens [b-1] from draft logits [b-1, V], with their warped
        log-probabilities q (None when greedy). Under a constraint each row is
        masked after the drafts before it and drawn in turn (a host round
        trip per row), so no draft leaves the grammar."""
        if self.constraint is None:
            return self._draw(logits)
        drafted, qs = [], []
        for i in range(logits.shape[0]):
            token, q = self._draw(self.constraint.restrict_next(logits[i : i + 1], drafted))
            drafted.append(token.item())
            qs.append(q)
        q = None if self.greedy else mx.concatenate(qs, axis=0)
        return mx.array(drafted, dtype=mx.int32), q

    def _draw(self, logits: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        if self.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32), None
        q = warp(logits, self.params)
        return mx.random.categorical(q, key=self._next_key()).astype(mx.int32), q

    def acceptance(self, logits: mx.array, token: int, drafted: int, q: Optional[mx.array]):
        """The probability that verifying accepts draft ``drafted`` (drawn from
        warped log-probabilities ``q`` [V]) where the target's processed logits
        are ``logits`` [1, V] and its own token was ``token``: 1.0 or 0.0 when
        greedy, else min(1, p/q) (a lazy scalar)."""
        if self.greedy:
            return float(token == drafted)
        return mx.minimum(mx.exp(warp(logits, self.params)[0, drafted] - q[drafted]), 1.0)

    def verify(self, logits: mx.array, drafted: mx.array, q: Optional[mx.array]):
        """(accepted, next_token) for target logits [b, V] over [y, d_1..d_{b-1}]."""
        if self.greedy:
            accepted, next_token = greedy_verify(logits[None], drafted[None])
        else:
            accepted, next_token = sampled_verify(
                warp(logits, self.params)[None], q[None], drafted[None], self._next_key()
            )
        return accepted, next_token
