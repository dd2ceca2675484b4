"""Block verification: how many drafted tokens the target accepts, and the
token it emits after them. One small result per cycle for the host.

Each rule runs in its Metal kernel where the kernel is active (one launch, one
packed int per sequence) and in its pure-MLX semantics from
:mod:`dflash_mlx.loop.acceptance` everywhere else.
"""

import mlx.core as mx

from . import acceptance
from ..kernels import verify_greedy, verify_sampled


def greedy_verify(logits: mx.array, drafted: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance of a block (:func:`dflash_mlx.loop.acceptance.greedy`).

    logits: [B, b, V] target logits; drafted: [B, b-1] int32 drafted tokens.
    Returns (accepted [B] int32, next_token [B] int32).
    """
    if verify_greedy.KERNEL.active(logits, drafted):
        _, packed = verify_greedy.KERNEL.launch(logits, drafted)
        return acceptance.unpack(packed)
    return acceptance.greedy(logits, drafted)


def sampled_verify(
    target_logprobs: mx.array, draft_logprobs: mx.array, drafted: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Lossless rejection sampling of a block (:func:`dflash_mlx.loop.acceptance.sampled`).

    target_logprobs: [B, b, V] warped target log-probabilities p_0..p_{b-1}.
    draft_logprobs: [B, b-1, V] warped draft log-probabilities q_1..q_{b-1}.
    drafted: [B, b-1] int32 tokens, d_i drawn from q_i.
    Returns (accepted [B], next_token [B]).

    The randomness is drawn here, from ``key``: b+1 uniforms per sequence (one
    per draft, two for the inverse-CDF draw of the next token); the rule itself
    is deterministic.
    """
    B, b = target_logprobs.shape[:2]
    uniforms = mx.random.uniform(shape=(B, b + 1), key=key)
    (packed,) = verify_sampled.KERNEL(target_logprobs, draft_logprobs, drafted, uniforms)
    return acceptance.unpack(packed)
