"""Kernel: KV injection for every draft layer (``metal/kv_inject.metal``).

The draft appends, for each layer l, ``K = rope(k_norm_l(k_proj_l(ctx)))`` at
the context's absolute positions and ``V = v_proj_l(ctx)`` to layer l's
context cache (docs/architecture.md, "Drafting"). Done layer by layer that is
about 4n small ops. Here it is two: one matmul with the K/V projections of all
layers stacked (``dflash_mlx/draft/injection.py`` builds it), then this one
launch, which applies every layer's k_norm and RoPE (given as inverse
frequencies, a position scale and a magnitude scale) and lays K and V out for
the caches.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .registry import TOLERANCES, Kernel, Launch, mismatch

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_HEAD_DIM = 512  # 8 rotation pairs per lane
MAX_POSITION = 1 << 24  # positions stay exact in float32


def default_inv_freq(head_dim: int, base: float) -> mx.array:
    """nn.RoPE's inverse frequencies base^(-2j/D), computed in float64."""
    j = np.arange(0, head_dim, 2, dtype=np.float64)
    return mx.array((base ** (-j / head_dim)).astype(np.float32))


def make_inputs(rng: np.random.Generator, *, B: int, T: int, n_layers: int, n_kv: int, head_dim: int,
                dtype=mx.float32, offset: int = 0, base: float = 10000.0):
    """Random kernel arguments: (inputs tuple, params dict)."""
    kv = mx.array(rng.normal(size=(B, T, 2 * n_layers * n_kv * head_dim)).astype(np.float32)).astype(dtype)
    norm_w = mx.array((1 + 0.2 * rng.normal(size=(n_layers, head_dim))).astype(np.float32)).astype(dtype)
    params = dict(n_layers=n_layers, n_kv=n_kv, head_dim=head_dim, eps=1e-6)
    return (kv, norm_w, default_inv_freq(head_dim, base), offset), params



class KvInject(Kernel):
    name = "kv_inject"
    source_file = "kv_inject.metal"
    input_names = ("kv", "norm_w", "inv_freq", "params", "offset")
    output_names = ("keys", "values")
    description = "every draft layer's k_norm + RoPE and K/V cache layout in one launch"

    def reference(self, kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim,
                  eps, pos_scale=1.0, mscale=1.0) -> tuple[mx.array, mx.array]:
        """Pure-MLX semantics of the kernel. Returns keys, values [L, B, H, T, D]."""
        B, T, _ = kv.shape
        x = kv.reshape(B, T, n_layers, 2, n_kv, head_dim).transpose(2, 3, 0, 4, 1, 5)
        freqs = 1.0 / inv_freq.astype(mx.float32)
        norm_w = norm_w.astype(kv.dtype)  # the kernel's outputs have kv's dtype
        keys = []
        for layer in range(n_layers):
            k = mx.fast.rms_norm(x[layer, 0], norm_w[layer], eps)
            if mscale != 1.0:
                k = k * mscale
            keys.append(mx.fast.rope(k, head_dim, traditional=False, base=None, scale=pos_scale,
                                     offset=offset, freqs=freqs))
        return mx.stack(keys), x[:, 1]

    def kernel_inputs(self, kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim,
                      eps, pos_scale=1.0, mscale=1.0) -> list:
        params = mx.array([eps, pos_scale, mscale], dtype=mx.float32)
        return [kv, norm_w.astype(kv.dtype), inv_freq.astype(mx.float32), params,
                mx.array(offset, dtype=mx.int32)]

    def configure(self, kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim, **_) -> Launch:
        B, T, _ = kv.shape
        units = 2 * n_layers * n_kv
        shape = (n_layers, B, n_kv, T, head_dim)
        return Launch(
            grid=(32 * units, T, B),
            threadgroup=(min(256, 32 * units), 1, 1),
            output_shapes=[shape, shape],
            output_dtypes=[kv.dtype, kv.dtype],
            template=[("T", kv.dtype), ("HEAD_DIM", head_dim)],
        )

    def unsupported(self, kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim, **_) -> Optional[str]:
        if kv.ndim != 3:
            return "kv must be [B, T, C]"
        if kv.dtype not in DTYPES:
            return f"dtype {kv.dtype} (kernel: float32, float16, bfloat16)"
        if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
            return f"head_dim {head_dim} (kernel: even, 2..{MAX_HEAD_DIM})"
        if kv.shape[-1] != 2 * n_layers * n_kv * head_dim:
            return f"kv has {kv.shape[-1]} columns, expected {2 * n_layers * n_kv * head_dim}"
        if tuple(norm_w.shape) != (n_layers, head_dim) or tuple(inv_freq.shape) != (head_dim // 2,):
            return "norm_w must be [L, D] and inv_freq [D/2]"
        if not (0 <= offset and offset + kv.shape[1] <= MAX_POSITION):
            return f"positions beyond {MAX_POSITION}"
        return None

    def compare(self, got, want, inputs, params) -> Optional[str]:
        kv, _, inv_freq, offset = inputs
        rtol, atol = TOLERANCES[kv.dtype]
        if kv.dtype == mx.float32:
            # float32 RoPE angles carry about position * 2^-24 rad of rounding, and
            # implementations round them differently: allow that much rotation
            last = (offset + kv.shape[1]) * params.get("pos_scale", 1.0) * float(mx.max(inv_freq))
            peak = float(mx.max(mx.abs(want[0]))) if want[0].size else 0.0
            atol += 4 * last * 2.0**-24 * peak
        return (mismatch("keys", got[0], want[0], rtol, atol)
                or mismatch("values", got[1], want[1]))  # values are a copy: bit-exact

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        return make_inputs(rng, B=1, T=3, n_layers=2, n_kv=2, head_dim=64, offset=5)


KERNEL = KvInject()

__all__ = ["KERNEL", "KvInject", "default_inv_freq", "make_inputs"]
