"""Kernel: rejection-sampling block verification (``metal/verify_sampled.metal``).

The lossless rule of DESIGN.md section 2 ("Sampling at temperature > 0") in
one launch: from the warped target log-probabilities ``[B, b, V]``, the warped
draft log-probabilities ``[B, b-1, V]``, the drafted tokens ``[B, b-1]`` and
``b + 1`` uniforms per sequence drawn by MLX's RNG, it gives the accepted
length and the next token packed in one int32 per sequence, exactly as
``verify_greedy`` does::

    packed = (accepted << 24) | token

Why the inputs are *warped log-probabilities* and not raw logits plus the
warping parameters: the warping is mlx-lm's own (``apply_top_p``,
``apply_min_p``, ``apply_top_k``, then the temperature; see
:func:`dflash_mlx.sampling.warp`), so "the target's distribution" means exactly
what it means in mlx-lm. Top-p needs a sort over the vocabulary, which a
verification kernel would have to reimplement (and could only approximate
bit for bit); and the draft's warped q is already computed once to sample the
drafts, so passing it on costs nothing. The kernel starts where those
functions end.

Why the uniforms are inputs: the kernel then is a deterministic function of
its inputs, MLX's RNG (and the seed) stays the only source of randomness, and
kernel and reference can be compared exactly.

Arithmetic (the kernel's and :func:`sample_reference`'s, step for step):

1. draft i is accepted iff ``0 <= d_i < V`` and ``u_i * q < p`` in float32,
   ``p = exp(target[s, i, d_i])``, ``q = exp(draft[s, i, d_i])``: probability
   min(1, p/q); p = 0 (a draft outside the target's top-k/top-p support) is
   never accepted.
2. the next token comes from row a in 2^-39 fixed point, ``F(x) =
   floor(clamp(x, 0, 1) * 2^39)`` as uint64: ``P = F(exp(target[s, a]))``,
   ``R = max(P - F(exp(draft[s, a])), 0)``; weights R, or P when every draft
   was accepted or R has no mass (p = q). Integer sums are exact in any order,
   so the threads' order cannot change them.
3. inverse CDF with a 48-bit uniform built from the last two uniforms
   (24 bits each): ``goal = floor(U * sum(w) / 2^48)``, token = the first j
   whose prefix sum exceeds ``goal``. The token always has w_j > 0.

The fixed point drops probability mass below 2^-39 per token (at most
V * 2^-39, 4.5e-7 for V = 248,320) and the 48-bit draw quantizes the CDF to
2^-48: both far below float32 rounding of the probabilities themselves.

``exp`` is ``metal::precise::exp`` in the kernel, which is what ``mx.exp``
runs on Metal: kernel and reference agree bit for bit there. The emulation
harness computes exp with glibc's ``expf`` and MLX's CPU backend with its own
approximation (they differ by up to ~60 units in the last place); tests
therefore compare bit for bit against :func:`sample_reference` given the
harness's exp, and decision for decision against the plain reference on inputs
whose decisions are not within that noise of a boundary (:func:`make_inputs`).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .registry import KernelSpec, Launch, mismatch, register
from .verify_greedy import ACCEPT_SHIFT, MAX_BLOCK, MAX_VOCAB, pack, threadgroup_width, unpack

FIX_BITS = 39  # weights in units of 2^-39: V * 2^39 < 2^63 for V <= 2^24, no overflow
FIX_ONE = float(1 << FIX_BITS)
DRAW_BITS = 24  # bits taken from each of the two drawing uniforms
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
INDEX_DTYPES = (mx.int32, mx.uint32, mx.int64, mx.uint64, mx.int16, mx.uint16)

__all__ = [
    "ACCEPT_SHIFT", "FIX_BITS", "KERNEL", "draw_goal", "fixed_point", "make_inputs", "pack",
    "reference", "sample_reference", "unpack",
]


# ---------------------------------------------------------------- the arithmetic
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


def sample_reference(target_logprobs: mx.array, draft_logprobs: mx.array, drafted: mx.array,
                     uniforms: mx.array, exp: Callable[[mx.array], mx.array] = mx.exp) -> mx.array:
    """The kernel's semantics in MLX ops; returns packed [B] int32.

    ``exp`` maps float32 to float32 (default ``mx.exp``); tests pass the
    emulation harness's exp to compare bit for bit."""
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


def reference(target_logprobs, draft_logprobs, drafted, uniforms) -> tuple[mx.array]:
    return (sample_reference(target_logprobs, draft_logprobs, drafted, uniforms),)


# ---------------------------------------------------------------- launch and dispatch
def kernel_inputs(target_logprobs, draft_logprobs, drafted, uniforms) -> list:
    return [target_logprobs, draft_logprobs, drafted.astype(mx.int32), uniforms.astype(mx.float32)]


def configure(target_logprobs, draft_logprobs, drafted, uniforms) -> Launch:
    B, b, V = target_logprobs.shape
    width = threadgroup_width(V)
    return Launch(
        grid=(width, B, 1),
        threadgroup=(width, 1, 1),
        output_shapes=[(B,)],
        output_dtypes=[mx.int32],
        template=[("T", target_logprobs.dtype), ("Q", draft_logprobs.dtype)],
    )


def unsupported(target_logprobs, draft_logprobs, drafted, uniforms) -> Optional[str]:
    if target_logprobs.ndim != 3 or draft_logprobs.ndim != 3 or drafted.ndim != 2 or uniforms.ndim != 2:
        return "target_logprobs must be [B, b, V], draft_logprobs [B, b-1, V], drafted [B, b-1], uniforms [B, b+1]"
    B, b, V = target_logprobs.shape
    if tuple(draft_logprobs.shape) != (B, b - 1, V):
        return f"draft_logprobs has shape {tuple(draft_logprobs.shape)}, expected {(B, b - 1, V)}"
    if tuple(drafted.shape) != (B, b - 1):
        return f"drafted has shape {tuple(drafted.shape)}, expected {(B, b - 1)}"
    if tuple(uniforms.shape) != (B, b + 1):
        return f"uniforms has shape {tuple(uniforms.shape)}, expected {(B, b + 1)}"
    for name, x in (("target_logprobs", target_logprobs), ("draft_logprobs", draft_logprobs)):
        if x.dtype not in DTYPES:
            return f"{name} dtype {x.dtype} (kernel: float32, float16, bfloat16)"
    if not 2 <= b <= MAX_BLOCK:
        return f"block of {b} (kernel: 2..{MAX_BLOCK})"
    if not 1 <= V <= MAX_VOCAB:
        return f"vocabulary of {V} (kernel: up to {MAX_VOCAB})"
    if drafted.dtype not in INDEX_DTYPES:
        return f"drafted dtype {drafted.dtype}"
    if uniforms.dtype not in DTYPES:
        return f"uniforms dtype {uniforms.dtype}"
    return None


# ---------------------------------------------------------------- inputs for checks and tests
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def make_inputs(rng: np.random.Generator, B: int, b: int, V: int, dtype=mx.float32, draft_dtype=None,
                accept: Optional[list[int]] = None, scale: float = 2.0, noise: float = 0.7,
                margin: float = 1e-4):
    """Random warped log-probabilities, drafts and uniforms whose decisions are
    *non-degenerate*: every acceptance test has ``u * q`` and ``p`` at least
    ``margin`` (relative) apart, and the drawing uniforms put the goal in the
    middle of a token whose fixed-point weight is wide compared with what exp
    rounding (``margin`` relative, both rows) and truncation (one unit per
    token) can move. Such inputs give the same result with any exp accurate to
    well under ``margin``. Sequence s accepts ``accept[s]`` drafts (random by
    default). The target row used for the draw is sampled like a real block: the
    drafted token at the rejection is one q favours over p.

    Returns ((target_logprobs, draft_logprobs, drafted, uniforms), accepted).
    """
    draft_dtype = draft_dtype or dtype
    n = b - 1
    z = rng.normal(size=(B, b, V)) * scale
    zq = z[:, :n] + rng.normal(size=(B, n, V)) * noise * scale
    target = mx.array(_log_softmax(z)).astype(dtype)
    draft = mx.array(_log_softmax(zq)).astype(draft_dtype)
    p = np.exp(np.array(target.astype(mx.float32), dtype=np.float64))
    q = np.exp(np.array(draft.astype(mx.float32), dtype=np.float64))
    drafted = np.zeros((B, n), dtype=np.int32)
    uniforms = np.zeros((B, b + 1), dtype=np.float32)
    accepted = []
    for s in range(B):
        a = int(rng.integers(0, b)) if accept is None else int(accept[s])
        accepted.append(a)
        for i in range(n):
            qi = q[s, i] / q[s, i].sum()
            if i < a:  # accept: u below the ratio
                d = int(rng.choice(V, p=qi))
                ratio = min(1.0, p[s, i, d] / q[s, i, d])
                u = rng.uniform(0, ratio * (1 - margin))
            elif i == a:  # reject: a token q favours, u above the ratio
                ratios = p[s, i] / q[s, i]
                candidates = np.flatnonzero(ratios < 0.5)
                d = int(rng.choice(candidates, p=qi[candidates] / qi[candidates].sum()))
                u = rng.uniform(ratios[d] * (1 + margin), 1.0)
            else:  # never looked at: anything
                d, u = int(rng.integers(0, V)), rng.uniform()
            drafted[s, i] = d
            uniforms[s, i] = np.float32(u)
        # the row the token is drawn from, in float64 fixed point
        P = np.floor(np.clip(p[s, a], 0, 1) * FIX_ONE)
        w = np.maximum(P - np.floor(np.clip(q[s, a], 0, 1) * FIX_ONE), 0) if a < n else P
        if w.sum() == 0:
            w = P
        slack = margin * 2 * FIX_ONE + 2 * V  # how far exp noise and truncation can move a boundary
        wide = np.flatnonzero(w > 8 * slack)
        j = int(rng.choice(wide, p=w[wide] / w[wide].sum()))
        goal = w[:j].sum() + w[j] / 2
        U = int(goal / w.sum() * 2.0**48)
        uniforms[s, n] = (U >> DRAW_BITS) / 2.0**DRAW_BITS
        uniforms[s, n + 1] = (U & ((1 << DRAW_BITS) - 1)) / 2.0**DRAW_BITS
    inputs = (target, draft, mx.array(drafted), mx.array(uniforms))
    return inputs, accepted


def sample(rng: np.random.Generator) -> tuple[tuple, dict]:
    inputs, _ = make_inputs(rng, 2, 5, 1000, accept=[1, 4])
    return inputs, {}


def compare(got, want, inputs, params) -> Optional[str]:
    return mismatch("packed", got[0], want[0])


KERNEL = register(KernelSpec(
    name="verify_sampled",
    source_file="verify_sampled.metal",
    input_names=("target_logprobs", "draft_logprobs", "drafted", "uniforms"),
    output_names=("packed",),
    reference=reference,
    kernel_inputs=kernel_inputs,
    configure=configure,
    sample=sample,
    compare=compare,
    unsupported=unsupported,
    description="rejection-sampling block verification: accepted length and next token in one launch",
))
