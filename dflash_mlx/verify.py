"""Block verification: how many drafted tokens the target accepts, and the
token it emits after them. One small result per cycle for the host.

Kernel dispatch (Metal where available) plugs in here; these are the pure-MLX
reference semantics every backend must reproduce.
"""

import mlx.core as mx


def greedy_verify(logits: mx.array, drafted: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance of a block.

    logits: [B, b, V] target logits at the block positions.
    drafted: [B, b-1] int32 drafted tokens d_1..d_{b-1}.
    Returns (accepted [B] int32: leading drafts equal to the target's argmax,
    next_token [B] int32: the target's argmax right after them).
    """
    choices = mx.argmax(logits, axis=-1).astype(mx.int32)
    matches = (drafted == choices[:, :-1]).astype(mx.int32)
    accepted = mx.cumprod(matches, axis=1).sum(axis=1).astype(mx.int32)
    next_token = mx.take_along_axis(choices, accepted[:, None], axis=1)[:, 0]
    return accepted, next_token
