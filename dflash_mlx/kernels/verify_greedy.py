"""Kernel: greedy block verification (``metal/verify_greedy.metal``).

From the target logits [B, b, V] and the drafted tokens [B, b-1], one launch
gives every row's argmax and, packed in one int32 per sequence, the accepted
length and the target's token after it::

    packed = (accepted << ACCEPT_SHIFT) | token

The loop synchronises on ``packed`` only. The semantics are those of
:func:`dflash_mlx.loop.acceptance.greedy`; the rejection-sampling kernel uses the
same packed result.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..loop.acceptance import MAX_BLOCK, MAX_VOCAB, greedy, pack, unpack
from .registry import Kernel, Launch

INIT = float(1 << 30)  # above any packed result: (63 << 24) | token < 2^30
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def threadgroup_width(vocab: int) -> int:
    """Threads per row: enough for ~8 logits each, a multiple of 32, at most 1024."""
    want = -(-vocab // 8)
    return int(min(1024, max(32, -(-want // 32) * 32)))


def make_inputs(rng: np.random.Generator, B: int, b: int, V: int, dtype=mx.float32,
                ties: bool = False, accept: Optional[list[int]] = None) -> tuple[mx.array, mx.array]:
    """Random logits and drafts; sequence s agrees with the argmax for its first
    ``accept[s]`` drafts (random by default). ``ties`` makes many equal maxima."""
    x = rng.normal(size=(B, b, V)).astype(np.float32)
    if ties:
        x = np.clip(np.round(x), -2, 2)  # five values: the maximum repeats many times a row
    logits = mx.array(x).astype(dtype)
    best = np.array(mx.argmax(logits, axis=-1))
    drafted = rng.integers(0, V, size=(B, b - 1)).astype(np.int32)
    for s in range(B):
        a = int(rng.integers(0, b)) if accept is None else accept[s]
        drafted[s, :a] = best[s, :a]
        if a < b - 1 and drafted[s, a] == best[s, a]:
            drafted[s, a] = (best[s, a] + 1) % V
    return logits, mx.array(drafted)


class VerifyGreedy(Kernel):
    name = "verify_greedy"
    source_file = "verify_greedy.metal"
    input_names = ("logits", "drafted")
    output_names = ("argmax", "packed")
    atomic_outputs = True
    description = "greedy block verification: row argmax, accepted length and next token in one launch"

    def reference(self, logits: mx.array, drafted: mx.array) -> tuple[mx.array, mx.array]:
        accepted, token = greedy(logits, drafted)
        return mx.argmax(logits, axis=-1).astype(mx.int32), pack(accepted, token)

    def kernel_inputs(self, logits: mx.array, drafted: mx.array) -> list:
        return [logits, drafted.astype(mx.int32)]

    def configure(self, logits: mx.array, drafted: mx.array) -> Launch:
        B, b, V = logits.shape
        width = threadgroup_width(V)
        return Launch(
            grid=(width, b, B),
            threadgroup=(width, 1, 1),
            output_shapes=[(B, b), (B,)],
            output_dtypes=[mx.int32, mx.int32],
            template=[("T", logits.dtype)],
            init_value=INIT,
        )

    def unsupported(self, logits: mx.array, drafted: mx.array) -> Optional[str]:
        if logits.ndim != 3 or drafted.ndim != 2:
            return "logits must be [B, b, V] and drafted [B, b-1]"
        B, b, V = logits.shape
        if tuple(drafted.shape) != (B, b - 1):
            return f"drafted has shape {tuple(drafted.shape)}, expected {(B, b - 1)}"
        if logits.dtype not in DTYPES:
            return f"logits dtype {logits.dtype} (kernel: float32, float16, bfloat16)"
        if not 2 <= b <= MAX_BLOCK:
            return f"block of {b} (kernel: 2..{MAX_BLOCK})"
        if not 1 <= V <= MAX_VOCAB:
            return f"vocabulary of {V} (kernel: up to {MAX_VOCAB})"
        if drafted.dtype not in (mx.int32, mx.uint32, mx.int64, mx.uint64, mx.int16, mx.uint16):
            return f"drafted dtype {drafted.dtype}"
        return None

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        logits, drafted = make_inputs(rng, 2, 5, 1000, accept=[2, 4])
        return (logits, drafted), {}


KERNEL = VerifyGreedy()

__all__ = ["KERNEL", "VerifyGreedy", "make_inputs", "pack", "threadgroup_width", "unpack"]
