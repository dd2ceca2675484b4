"""Kernel: the block-verify quantized matmul (``metal/qmm_verify.metal``).

``y[M, N] = x[M, K] @ dequant(w)[N, K]^T`` for M = 1..32 rows (a verified
block of up to 16 tokens, or a tree of up to 32 nodes) with MLX's affine
quantization, 4 or 8 bits, group size 32, 64 or 128, float16 / bfloat16 /
float32 activations. The reference is ``mx.quantized_matmul``. This matmul is
the dominant cost of verification on quantized targets (see ``metal/README.md``).

The target adapter routes a verify pass's quantized linears through it
(``dflash_mlx/verify_matmuls.py``); inputs the kernel does not cover (more
than 32 rows, other bits or group sizes, ``mxfp4`` and the other non-affine
modes, unknown dtypes) go to ``mx.quantized_matmul``.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .registry import Kernel, Launch

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MAX_ROWS = 32
BLOCK_N = 64  # output columns per threadgroup (BN in the source)
THREADS = 128

# Comparison with mx.quantized_matmul, per output dtype: |kernel - reference| <=
# TOL * sum_k |x[m, k]| |dequant(w)[n, k]|. The kernel dequantizes and sums in
# float and rounds once; the reference may round the dequantized weights, or
# partial sums, to the activation dtype (MLX's CPU path is measured at up to
# 1.6e-3 of that scale for float16 and 1.1e-2 for bfloat16). The factors are 4
# units in the last place of the type (2^-22 for float32).
TOLERANCE = {mx.float32: 2.0**-22 * 4, mx.float16: 2.0**-10 * 4, mx.bfloat16: 2.0**-7 * 4}


# ---------------------------------------------------------------- inputs and tolerance
def make_inputs(rng: np.random.Generator, M: int, N: int, K: int, *, bits: int = 4, group_size: int = 64,
                dtype=mx.float32) -> tuple[tuple, dict]:
    """Random activations and a random weight quantized with ``mx.quantize``."""
    x = mx.array(rng.normal(size=(M, K)).astype(np.float32)).astype(dtype)
    weight = mx.array((rng.normal(size=(N, K)) / np.sqrt(K)).astype(np.float32)).astype(dtype)
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return (x, w, scales, biases), dict(group_size=group_size, bits=bits)


def error_scale(x, w, scales, biases, *, group_size: int, bits: int) -> np.ndarray:
    """sum_k |x[m, k]| |dequant(w)[n, k]| in float64: the size of the rounding an
    exact-in-float kernel and the reference may each make."""
    deq = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
    return np.abs(np.array(x.astype(mx.float32), dtype=np.float64)) @ np.abs(np.array(deq, dtype=np.float64)).T


class QmmVerify(Kernel):
    name = "qmm_verify"
    source_file = "qmm_verify.metal"
    input_names = ("x", "w", "scales", "biases")
    output_names = ("y",)
    description = "quantized matmul for 1..32 rows (verified blocks): affine 4/8-bit, group 32/64/128"

    def reference(self, x, w, scales, biases, *, group_size: int, bits: int) -> tuple[mx.array]:
        return (mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits),)

    def configure(self, x, w, scales, biases, *, group_size: int, bits: int) -> Launch:
        M = x.shape[0]
        N = w.shape[0]
        return Launch(
            grid=(THREADS, -(-N // BLOCK_N), 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(M, N)],
            output_dtypes=[x.dtype],
            template=[("T", x.dtype), ("S", scales.dtype), ("BITS", bits),
                      ("GROUP_SIZE", group_size), ("MT", -(-M // 8))],
        )

    def unsupported(self, x, w, scales, biases, *, group_size: int, bits: int) -> Optional[str]:
        if x.ndim != 2:
            return "x must be [M, K]"
        M, K = x.shape
        if not 1 <= M <= MAX_ROWS:
            return f"{M} rows (kernel: 1..{MAX_ROWS})"
        if x.dtype not in DTYPES:
            return f"dtype {x.dtype} (kernel: float32, float16, bfloat16)"
        if bits not in BITS:
            return f"{bits}-bit (kernel: 4 or 8)"
        if group_size not in GROUP_SIZES:
            return f"group size {group_size} (kernel: 32, 64, 128)"
        if biases is None:
            return "no biases (kernel: affine quantization)"
        if K % group_size:
            return f"K = {K} is not a multiple of the group size"
        N = w.shape[0]
        if w.dtype != mx.uint32 or tuple(w.shape) != (N, K * bits // 32):
            return f"w has shape {tuple(w.shape)} and dtype {w.dtype}, expected ({N}, {K * bits // 32}) uint32"
        if tuple(scales.shape) != (N, K // group_size) or tuple(biases.shape) != (N, K // group_size):
            return "scales and biases must be [N, K / group_size]"
        if scales.dtype != x.dtype or biases.dtype != x.dtype:
            # MLX promotes mixed types (bfloat16 x with float32 scales gives float32):
            # leave those to it rather than pick an output type
            return f"x {x.dtype} with scales {scales.dtype} and biases {biases.dtype} (kernel: all one dtype)"
        return None

    def compare(self, got, want, inputs, params) -> Optional[str]:
        g, w = got[0], want[0]
        if tuple(g.shape) != tuple(w.shape):
            return f"y: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if g.dtype != w.dtype:
            return f"y: dtype {g.dtype} != {w.dtype}"
        gn = np.array(g.astype(mx.float32), dtype=np.float64)
        wn = np.array(w.astype(mx.float32), dtype=np.float64)
        bound = TOLERANCE[inputs[0].dtype] * error_scale(*inputs, **params) + 1e-30
        bad = ~(np.abs(gn - wn) <= bound)
        if not bad.any():
            return None
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        return (f"y: {int(bad.sum())} of {bad.size} elements differ beyond {TOLERANCE[inputs[0].dtype]:.2e} "
                f"x sum|x||w| (first at {first}: {gn[first]!r} vs {wn[first]!r})")

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        return make_inputs(rng, 11, 70, 128, bits=4, group_size=32, dtype=mx.float16)


KERNEL = QmmVerify()

__all__ = ["KERNEL", "QmmVerify", "error_scale", "make_inputs"]
