"""Kernel: rejection-sampling block verification (``metal/verify_sampled.metal``).

The lossless rule of :func:`dflash_mlx.loop.acceptance.sampled` (docs/architecture.md,
"Sampling") in one launch: from the warped target log-probabilities ``[B, b, V]``, the warped
draft log-probabilities ``[B, b-1, V]``, the drafted tokens ``[B, b-1]`` and
``b + 1`` uniforms per sequence drawn by MLX's RNG, it gives the accepted
length and the next token packed in one int32 per sequence, exactly as
``verify_greedy`` does::

    packed = (accepted << 24) | token

Why the inputs are *warped log-probabilities* and not raw logits plus the
warping parameters: the warping is mlx-lm's own (``apply_top_p``,
``apply_min_p``, ``apply_top_k``, then the temperature; see
:func:`dflash_mlx.loop.sampling.warp`), so "the target's distribution" means exactly
what it means in mlx-lm. Top-p needs a sort over the vocabulary, which a
verification kernel would have to reimplement (and could only approximate
bit for bit); and the draft's warped q is already computed once to sample the
drafts, so passing it on costs nothing. The kernel starts where those
functions end.

Why the uniforms are inputs: the kernel then is a deterministic function of
its inputs, MLX's RNG (and the seed) stays the only source of randomness, and
kernel and reference can be compared exactly.

Arithmetic (the kernel's and :func:`dflash_mlx.loop.acceptance.sampled`'s, step for step):

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
therefore compare bit for bit against the reference given the
harness's exp, and decision for decision against the plain reference on inputs
whose decisions are not within that noise of a boundary (:func:`make_inputs`).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..loop.acceptance import DRAW_BITS, FIX_ONE, MAX_BLOCK, MAX_VOCAB, pack, sampled, unpack
from .registry import Kernel, Launch
from .verify_greedy import threadgroup_width

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
INDEX_DTYPES = (mx.int32, mx.uint32, mx.int64, mx.uint64, mx.int16, mx.uint16)


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


class VerifySampled(Kernel):
    name = "verify_sampled"
    source_file = "verify_sampled.metal"
    input_names = ("target_logprobs", "draft_logprobs", "drafted", "uniforms")
    output_names = ("packed",)
    description = "rejection-sampling block verification: accepted length and next token in one launch"

    def reference(self, target_logprobs, draft_logprobs, drafted, uniforms) -> tuple[mx.array]:
        return (sampled(target_logprobs, draft_logprobs, drafted, uniforms),)

    def kernel_inputs(self, target_logprobs, draft_logprobs, drafted, uniforms) -> list:
        return [target_logprobs, draft_logprobs, drafted.astype(mx.int32), uniforms.astype(mx.float32)]

    def configure(self, target_logprobs, draft_logprobs, drafted, uniforms) -> Launch:
        B, b, V = target_logprobs.shape
        width = threadgroup_width(V)
        return Launch(
            grid=(width, B, 1),
            threadgroup=(width, 1, 1),
            output_shapes=[(B,)],
            output_dtypes=[mx.int32],
            template=[("T", target_logprobs.dtype), ("Q", draft_logprobs.dtype)],
        )


    def unsupported(self, target_logprobs, draft_logprobs, drafted, uniforms) -> Optional[str]:
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

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        inputs, _ = make_inputs(rng, 2, 5, 1000, accept=[1, 4])
        return inputs, {}


KERNEL = VerifySampled()

__all__ = ["KERNEL", "VerifySampled", "make_inputs", "pack", "unpack"]
