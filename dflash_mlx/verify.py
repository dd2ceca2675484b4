"""Block verification: how many drafted tokens the target accepts, and the
token it emits after them. One small result per cycle for the host.

``greedy_verify`` dispatches to the ``verify_greedy`` Metal kernel (one launch,
one tiny packed result; see dflash_mlx/kernels) where it is active, and to
``greedy_verify_reference``, the pure-MLX semantics every backend must
reproduce, everywhere else. A sampling kernel can sit beside it the same way,
returning the same packed (accepted << 24 | token) result.
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
