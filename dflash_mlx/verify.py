"""Block verification: how many drafted tokens the target accepts, and the
token it emits after them. One small result per cycle for the host.

``greedy_verify`` dispatches to the ``verify_greedy`` Metal kernel (one launch,
one tiny packed result; see dflash_mlx/kernels) where it is active, and to
``greedy_verify_reference``, the pure-MLX semantics every backend must
reproduce, everywhere else. ``sampled_verify`` does the same with the
``verify_sampled`` kernel and the same packed (accepted << 24 | token) result.
"""

import mlx.core as mx

from . import kernels


def greedy_verify(logits: mx.array, drafted: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance of a block.

    logits: [B, b, V] target logits at the block positions.
    drafted: [B, b-1] int32 drafted tokens d_1..d_{b-1}.
    Returns (accepted [B] int32: leading drafts equal to the target's argmax,
    next_token [B] int32: the target's argmax right after them).
    """
    kernel = kernels.verify_greedy.KERNEL
    if kernel.active(logits, drafted):
        _, packed = kernel.launch(logits, drafted)
        return kernels.verify_greedy.unpack(packed)
    return greedy_verify_reference(logits, drafted)


def greedy_verify_reference(logits: mx.array, drafted: mx.array) -> tuple[mx.array, mx.array]:
    """``greedy_verify`` in plain MLX ops (the semantics the kernel reproduces)."""
    choices = mx.argmax(logits, axis=-1).astype(mx.int32)
    matches = (drafted == choices[:, :-1]).astype(mx.int32)
    accepted = mx.cumprod(matches, axis=1).sum(axis=1).astype(mx.int32)
    next_token = mx.take_along_axis(choices, accepted[:, None], axis=1)[:, 0]
    return accepted, next_token


def sampled_verify(
    target_logprobs: mx.array, draft_logprobs: mx.array, drafted: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Lossless rejection sampling of a block (DESIGN.md §2).

    target_logprobs: [B, b, V] warped target log-probabilities p_0..p_{b-1}.
    draft_logprobs: [B, b-1, V] warped draft log-probabilities q_1..q_{b-1}.
    drafted: [B, b-1] int32 tokens, d_i drawn from q_i.
    Accept d_i with probability min(1, p(d_i)/q(d_i)) in order; at the first
    rejection draw from normalize(max(p - q, 0)) (p itself if that has no mass);
    if all are accepted draw the bonus from the last p. Returns (accepted [B],
    next_token [B]).

    The randomness is drawn here, from ``key``: b+1 uniforms per sequence (one
    per draft, two for the inverse-CDF draw of the next token). The rest is
    deterministic and runs in the ``verify_sampled`` kernel where it is active
    (one launch, one packed int per sequence), in its pure-MLX reference
    (``kernels.verify_sampled.sample_reference``) everywhere else.
    """
    B, b = target_logprobs.shape[:2]
    uniforms = mx.random.uniform(shape=(B, b + 1), key=key)
    (packed,) = kernels.verify_sampled.KERNEL(target_logprobs, draft_logprobs, drafted, uniforms)
    return kernels.verify_sampled.unpack(packed)
