"""The acceptance rules of block verification, in plain MLX ops.

These are the semantics every backend reproduces: the verification kernels
(``kernels/verify_greedy.py``, ``kernels/verify_sampled.py``) are proven
against them, and every non-Metal backend runs them. This module imports
nothing else of the package; ``verify.py`` dispatches between it and the
kernels. See docs/architecture.md ("Verification" and "Sampling").

Both rules give the accepted length and the token after it packed in one
int32 per sequence, the only value the loop synchronises on::

    packed = (accepted << ACCEPT_SHIFT) | token
"""

from typing import Callable

import mlx.core as mx

ACCEPT_SHIFT = 24
TOKEN_MASK = (1 << ACCEPT_SHIFT) - 1
MAX_VOCAB = 1 << ACCEPT_SHIFT
MAX_BLOCK = 64  # (63 << 24) | token < 2^30

FIX_BITS = 39  # weights in units of 2^-39: V * 2^39 < 2^63 for V <= 2^24, no overflow
FIX_ONE = float(1 << FIX_BITS)
DRAW_BITS = 24  # bits taken from each of the two drawing uniforms


def pack(accepted: mx.array, token: mx.array) -> mx.array:
    return (accepted.astype(mx.int32) << ACCEPT_SHIFT) | token.astype(mx.int32)


def unpack(packed: mx.array) -> tuple[mx.array, mx.array]:
    """(accepted [B] int32, token [B] int32) from a packed result."""
    return packed >> ACCEPT_SHIFT, packed & TOKEN_MASK


# ---------------------------------------------------------------- greedy
def greedy(logits: mx.array, drafted: mx.array) -> tuple[mx.array, mx.array]:
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


# ---------------------------------------------------------------- rejection sampling
def fixed_point(w: mx.array) -> mx.array:
    """float32 probabilities -> uint64 weights floor(clamp(w, 0, 1) * 2^39) (NaN -> 0)."""
    scaled = mx.where(w < 1.0, w * FIX_ONE, FIX_ONE)
    return mx.where(w > 0, scaled, 0.0).astype(mx.uint64)


def draw_goal(u_hi: mx.array, u_lo: mx.array, total: mx.array) -> mx.array:
    """floor(U * total / 2^48) for U = floor(u_hi 2^24) 2^24 + floor(u_lo 2^24),
    as the kernel computes it: the high 64 bits of (U << 16) * total in 32-bit limbs."""
    to_bits = lambda u: (u.astype(mx.float32) * float(1 << DRAW_BITS)).astype(mx.uint32).astype(mx.uint64)
    c = lambda v: mx.array(v, dtype=mx.uint64)
    u = (to_bits(u_hi) << c(64 - DRAW_BITS)) | (to_bits(u_lo) << c(64 - 2 * DRAW_BITS))
    m, s = c(0xFFFFFFFF), c(32)
    u1, u0, t1, t0 = u >> s, u & m, total >> s, total & m
    hl, lh = u1 * t0, u0 * t1
    return u1 * t1 + (hl >> s) + (lh >> s) + (((hl & m) + (lh & m) + ((u0 * t0) >> s)) >> s)


def sampled(target_logprobs: mx.array, draft_logprobs: mx.array, drafted: mx.array,
            uniforms: mx.array, exp: Callable[[mx.array], mx.array] = mx.exp) -> mx.array:
    """Lossless rejection sampling of a block; returns packed [B] int32.

    target_logprobs: [B, b, V] warped target log-probabilities p_0..p_{b-1}.
    draft_logprobs: [B, b-1, V] warped draft log-probabilities q_1..q_{b-1}.
    drafted: [B, b-1] tokens, d_i drawn from q_i. uniforms: [B, b+1] in [0, 1).

    1. d_i is accepted iff ``0 <= d_i < V`` and ``u_i * q < p`` in float32
       (probability min(1, p/q)), in order, up to the first rejection.
    2. The next token is drawn from row a, in 2^-39 fixed point: from
       max(p - q, 0) after a rejection, from p when every draft was accepted
       or the residual has no mass.
    3. Inverse CDF with a 48-bit uniform made of the last two uniforms.

    ``exp`` maps float32 to float32 (default ``mx.exp``); tests pass the
    emulation harness's exp to compare with the kernel bit for bit.
    """
    B, b, V = target_logprobs.shape
    n = b - 1
    f32 = lambda x: x.astype(mx.float32)
    uniforms = f32(uniforms)
    if n > 0:
        d = drafted.astype(mx.int32)
        valid = (d >= 0) & (d < V)
        index = mx.where(valid, d, 0)[..., None]
        p = exp(f32(mx.take_along_axis(target_logprobs[:, :n], index, axis=-1)[..., 0]))
        q = exp(f32(mx.take_along_axis(draft_logprobs, index, axis=-1)[..., 0]))
        ok = valid & (uniforms[:, :n] * q < p)
        accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)
    else:
        accepted = mx.zeros((B,), dtype=mx.int32)
    row = lambda x, i: f32(mx.take_along_axis(x, i[:, None, None], axis=1)[:, 0])
    P = fixed_point(exp(row(target_logprobs, accepted)))
    p_total = P.sum(axis=-1)
    if n > 0:
        Q = fixed_point(exp(row(draft_logprobs, mx.minimum(accepted, n - 1))))
        R = mx.where(P > Q, P - Q, 0)
        r_total = R.sum(axis=-1)
        use_r = (accepted < n) & (r_total > 0)
        weights = mx.where(use_r[:, None], R, P)
        total = mx.where(use_r, r_total, p_total)
    else:
        weights, total = P, p_total
    goal = draw_goal(uniforms[:, n], uniforms[:, n + 1], total)
    token = (mx.cumsum(weights, axis=-1) <= goal[:, None]).astype(mx.int32).sum(axis=-1)
    return pack(accepted, mx.minimum(token, V - 1))
