"""Kernel: the block-verify quantized matmul (``metal/qmm_verify.metal``).

``y[M, N] = x[M, K] @ dequant(w)[N, K]^T`` for M = 1..32 rows (a verified
block of up to 16 tokens, or a tree of up to 32 nodes) with MLX's affine
quantization, 4 or 8 bits, group size 32, 64 or 128, float16 / bfloat16 /
float32 activations. The reference is ``mx.quantized_matmul``. This matmul is
the dominant cost of verification on quantized targets (see ``metal/README.md``).

The target adapter puts it in the verify pass with :func:`verification_matmuls`,
which swaps *one model instance's* ``nn.QuantizedLinear`` layers for
:class:`VerifyLinear` for the duration of the pass and puts them back after it:
no mlx-lm class is patched, other instances are untouched, and the module tree
(parameters, weights) never changes. Inputs the kernel does not cover (more
than 32 rows, other bits or group sizes, ``mxfp4`` and the other non-affine
modes, unknown dtypes) go to ``mx.quantized_matmul`` exactly as the layer
itself would.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .registry import KernelSpec, Launch, current_backend, forced_reference, register

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


# ---------------------------------------------------------------- the kernel
def reference(x, w, scales, biases, *, group_size: int, bits: int) -> tuple[mx.array]:
    return (mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits),)


def kernel_inputs(x, w, scales, biases, *, group_size: int, bits: int) -> list:
    return [x, w, scales, biases]


def configure(x, w, scales, biases, *, group_size: int, bits: int) -> Launch:
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


def unsupported(x, w, scales, biases, *, group_size: int, bits: int) -> Optional[str]:
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


def make_inputs(rng: np.random.Generator, M: int, N: int, K: int, *, bits: int = 4, group_size: int = 64,
                dtype=mx.float32) -> tuple[tuple, dict]:
    """Random activations and a random weight quantized with ``mx.quantize``."""
    x = mx.array(rng.normal(size=(M, K)).astype(np.float32)).astype(dtype)
    weight = mx.array((rng.normal(size=(N, K)) / np.sqrt(K)).astype(np.float32)).astype(dtype)
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return (x, w, scales, biases), dict(group_size=group_size, bits=bits)


def sample(rng: np.random.Generator) -> tuple[tuple, dict]:
    return make_inputs(rng, 11, 70, 128, bits=4, group_size=32, dtype=mx.float16)


def error_scale(x, w, scales, biases, *, group_size: int, bits: int) -> np.ndarray:
    """sum_k |x[m, k]| |dequant(w)[n, k]| in float64: the size of the rounding an
    exact-in-float kernel and the reference may each make."""
    deq = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
    return np.abs(np.array(x.astype(mx.float32), dtype=np.float64)) @ np.abs(np.array(deq, dtype=np.float64)).T


def compare(got, want, inputs, params) -> Optional[str]:
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


KERNEL = register(KernelSpec(
    name="qmm_verify",
    source_file="qmm_verify.metal",
    input_names=("x", "w", "scales", "biases"),
    output_names=("y",),
    reference=reference,
    kernel_inputs=kernel_inputs,
    configure=configure,
    sample=sample,
    compare=compare,
    unsupported=unsupported,
    description="quantized matmul for 1..32 rows (verified blocks): affine 4/8-bit, group 32/64/128",
))


# ---------------------------------------------------------------- the layer wrapper
def quantized_matmul(x: mx.array, module: nn.Module) -> Optional[mx.array]:
    """``module``'s quantized matmul of ``x`` [..., K] through the kernel, or None
    when the kernel does not run for it (the caller then uses MLX)."""
    if getattr(module, "mode", "affine") != "affine":
        return None
    biases = module.get("biases")
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    if biases is None or rows > MAX_ROWS or x.ndim < 1:
        return None
    x2 = x.reshape(rows, x.shape[-1])
    args = (x2, module["weight"], module["scales"], biases)
    params = dict(group_size=module.group_size, bits=module.bits)
    if not KERNEL.active(*args, **params):
        return None
    (y,) = KERNEL.launch(*args, **params)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class VerifyLinear:
    """Stands in for one ``nn.QuantizedLinear`` while a block is verified: the
    kernel where it covers the input, else the layer's own call."""

    def __init__(self, inner: nn.QuantizedLinear):
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self.inner)
        if y is None:
            return self.inner(x)
        if "bias" in self.inner:
            y = y + self.inner["bias"]
        return y

    def __getattr__(self, name: str) -> Any:  # weight, scales, bits ... as the layer's
        return getattr(self.inner, name)


def _quantized_linears(module: nn.Module) -> list[tuple[Any, Any, nn.QuantizedLinear]]:
    """(parent module, attribute, layer) for every nn.QuantizedLinear that is a
    module's attribute under ``module``. Layers held directly in a list (none in
    the mlx-lm models we support) are left out: swapping a list item would change
    the parameter tree, so they keep MLX's matmul."""
    found: list = []
    seen: set[int] = set()

    def visit(container, key, value):
        if isinstance(value, nn.QuantizedLinear):
            if container is not None:
                found.append((container, key, value))
            return
        if isinstance(value, nn.Module):
            if id(value) in seen:
                return
            seen.add(id(value))
            for k, v in value.items():
                visit(value, k, v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(None, None, v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(None, None, v)

    visit(None, None, module)
    return found


def enabled() -> bool:
    """Whether the kernel can run at all here (backend, environment, self-check)."""
    if forced_reference(KERNEL.name):
        return False
    if not current_backend().available():
        return False
    return KERNEL.status(check=True) == "active"


class VerificationMatmuls:
    """The swap plan for one model instance: found once, applied per verify pass."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.sites = _quantized_linears(model)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[int]:
        """Within the block, the instance's quantized linears use the kernel.
        Yields how many were swapped (0 where the kernel cannot run)."""
        if not self.sites or not enabled():
            yield 0
            return
        done = []
        try:
            for parent, key, layer in self.sites:
                # an instance attribute shadows the module's child of the same
                # name for attribute lookup; the child itself (the parameter
                # tree) is left as it is. nn.Module.__setattr__ would drop it.
                object.__setattr__(parent, key, VerifyLinear(layer))
                done.append((parent, key))
            yield len(done)
        finally:
            for parent, key in reversed(done):
                vars(parent).pop(key, None)


def verification_matmuls(model: nn.Module):
    """Context manager: ``model``'s quantized linears use the kernel inside it."""
    return VerificationMatmuls(model)()


__all__ = [
    "KERNEL", "VerificationMatmuls", "VerifyLinear", "enabled", "make_inputs",
    "quantized_matmul", "reference", "verification_matmuls",
]
