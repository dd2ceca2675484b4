"""Kernels: GatedDeltaNet verify-and-rollback (``metal/gdn_verify.metal``,
``metal/gdn_replay.metal``).

Qwen3.5/3.6 hybrid targets keep, per GatedDeltaNet layer, a recurrent state
[B, Hv, Dv, Dk] in float32. Verifying a block of b tokens advances it b steps;
after a+1 tokens are accepted it must be the state after a+1 steps
(docs/architecture.md, "Rollback").

- ``gdn_verify`` runs the recurrence over the block (output and final state),
  exactly the semantics of mlx-lm's ``gated_delta_update`` (reference: mlx-lm's
  ``gated_delta_ops`` on the same g and beta).
- ``gdn_replay`` rebuilds the state after ``keep[s]`` steps of sequence s from
  the state before the block and the block's recorded k, v, g, beta, with the
  same arithmetic as the verify kernel, so it lands bit for bit on a state the
  verify pass went through.

Why replay rather than storing the per-step states: ``metal/README.md``
(per layer of Qwen3.5-9B, 16 states are 32 MiB written per pass; replay reads
and writes one state, 4 MiB, only when a block is cut short). The conv state is
rolled back by slicing the recorded conv input (``dflash_mlx.gated_delta``).

Padded (masked) batches are refused: the target adapter raises for them before
any kernel is involved, and the kernels take no mask.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .registry import Kernel, Launch, mismatch

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_DK = 256  # 8 state elements per lane

# y: units in the last place of its dtype, on top of the float error below
Y_ULPS = {mx.float32: 2.0**-23 * 4, mx.float16: 2.0**-10 * 2, mx.bfloat16: 2.0**-7 * 2}


def _gated_delta():
    from mlx_lm.models import gated_delta

    return gated_delta


# ---------------------------------------------------------------- shared checks
def unsupported_inputs(q_or_k, k, v, g, beta, state) -> Optional[str]:
    """Why the recurrence kernels cannot take these inputs, or None."""
    if q_or_k.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv]"
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if tuple(q_or_k.shape) != tuple(k.shape) or tuple(v.shape[:2]) != (B, T):
        return "q, k and v disagree in B, T or heads"
    if k.dtype not in DTYPES or q_or_k.dtype != k.dtype or v.dtype != k.dtype:
        return f"q/k/v dtypes {q_or_k.dtype}, {k.dtype}, {v.dtype} (kernel: one of float32, float16, bfloat16)"
    if Dk % 32 or not 32 <= Dk <= MAX_DK:
        return f"Dk = {Dk} (kernel: a multiple of 32 up to {MAX_DK})"
    if Hk < 1 or Hv % Hk:
        return f"Hv = {Hv} is not a multiple of Hk = {Hk}"
    if g.ndim != 3 or tuple(g.shape) != (B, T, Hv) or g.dtype != mx.float32:
        return f"g must be [B, T, Hv] float32 (vector gating is not covered), got {tuple(g.shape)} {g.dtype}"
    if tuple(beta.shape) != (B, T, Hv) or beta.dtype not in DTYPES:
        return "beta must be [B, T, Hv] float"
    if state is None or tuple(state.shape) != (B, Hv, Dv, Dk) or state.dtype != mx.float32:
        return "state must be [B, Hv, Dv, Dk] float32"
    if T < 1 or Dv < 1 or B < 1:
        return "empty block"
    return None


def launch_shape(k, v) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """One SIMD-group per value row of each (sequence, value head)."""
    B, _, _, _ = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    return (32, Dv, B * Hv), (32, 4, 1)


def state_tolerance(k: mx.array, state: mx.array, steps: int) -> float:
    """Absolute tolerance for states: each step's two Dk-term float sums may
    round differently in another order (about Dk units of 2^-24 each), carried
    over ``steps`` steps, on states of the size of the largest one."""
    Dk = k.shape[-1]
    peak = max(float(mx.max(mx.abs(state))), 1.0)
    return 4 * Dk * max(steps, 1) * 2.0**-24 * peak


def y_mismatch(got: mx.array, want: mx.array, tol: float) -> Optional[str]:
    """Outputs agree within the states' tolerance plus the final rounding to their dtype."""
    ulp = Y_ULPS[want.dtype]
    return mismatch("y", got, want, rtol=ulp, atol=tol + ulp)


# ---------------------------------------------------------------- inputs
def make_inputs(rng: np.random.Generator, *, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int,
                dtype=mx.float32, state_scale: float = 0.5):
    """Random verify-kernel arguments shaped as a qwen3_5 layer makes them: q, k
    through mlx-lm's ``normalize_qk``, g from its ``compute_g``, beta = sigmoid(b)."""
    gd = _gated_delta()

    def normal(*shape):
        return mx.array(rng.normal(size=shape).astype(np.float32))

    q, k = gd.normalize_qk(normal(B, T, Hk, Dk).astype(dtype), normal(B, T, Hk, Dk).astype(dtype),
                           inv_scale=Dk**-0.5, eps=1e-6)
    v = normal(B, T, Hv, Dv).astype(dtype)
    a = normal(B, T, Hv).astype(dtype)
    b = normal(B, T, Hv).astype(dtype)
    A_log = mx.array(np.log(rng.uniform(1, 16, size=Hv)).astype(np.float32))
    dt_bias = mx.array(rng.uniform(0, 1, size=Hv).astype(np.float32)).astype(dtype)
    g = gd.compute_g(A_log, a, dt_bias)
    beta = mx.sigmoid(b)
    state = normal(B, Hv, Dv, Dk) * state_scale
    return q, k, v, g, beta, state


class GdnVerify(Kernel):
    name = "gdn_verify"
    source_file = "gdn_verify.metal"
    input_names = ("q", "k", "v", "g", "beta", "state")
    output_names = ("y", "state_out")
    description = "GatedDeltaNet recurrence over a verified block (output and final state)"

    def reference(self, q, k, v, g, beta, state) -> tuple[mx.array, mx.array]:
        """mlx-lm's ops path of ``gated_delta_update`` after its g and beta."""
        return tuple(_gated_delta().gated_delta_ops(q, k, v, g, beta, state))

    def configure(self, q, k, v, g, beta, state) -> Launch:
        grid, tg = launch_shape(k, v)
        B, T, _, Dk = k.shape
        Hv, Dv = v.shape[2], v.shape[3]
        return Launch(
            grid=grid, threadgroup=tg,
            output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
            output_dtypes=[q.dtype, mx.float32],
            template=[("InT", q.dtype), ("Dk", Dk)],
        )

    def unsupported(self, q, k, v, g, beta, state) -> Optional[str]:
        return unsupported_inputs(q, k, v, g, beta, state)

    def compare(self, got, want, inputs, params) -> Optional[str]:
        q, k, v, g, beta, state = inputs
        T = k.shape[1]
        tol = state_tolerance(k, want[1], T)
        return y_mismatch(got[0], want[0], tol) or mismatch("state", got[1], want[1], atol=tol)

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        return make_inputs(rng, B=2, T=5, Hk=1, Hv=2, Dk=64, Dv=8), {}


class GdnReplay(Kernel):
    name = "gdn_replay"
    source_file = "gdn_replay.metal"
    input_names = ("k", "v", "g", "beta", "state", "keep")
    output_names = ("state_out",)
    description = "GatedDeltaNet rollback: the state after keep[s] steps of the block, replayed"

    def reference(self, k, v, g, beta, state, keep) -> tuple[mx.array]:
        """The state after the first keep[s] steps: mlx-lm's ops path with the later
        steps masked off (a masked step leaves the state as it was)."""
        T = k.shape[1]
        keep = mx.array(keep, dtype=mx.int32).reshape(-1)
        mask = mx.arange(T)[None, :] < keep[:, None]
        _, out = _gated_delta().gated_delta_ops(k, k, v, g, beta, state, mask)
        return (out,)

    def kernel_inputs(self, k, v, g, beta, state, keep) -> list:
        return [k, v, g, beta, state, mx.array(keep, dtype=mx.int32).reshape(-1)]

    def configure(self, k, v, g, beta, state, keep) -> Launch:
        grid, tg = launch_shape(k, v)
        return Launch(
            grid=grid, threadgroup=tg,
            output_shapes=[tuple(state.shape)],
            output_dtypes=[mx.float32],
            template=[("InT", k.dtype), ("Dk", k.shape[-1])],
        )

    def unsupported(self, k, v, g, beta, state, keep) -> Optional[str]:
        problem = unsupported_inputs(k, k, v, g, beta, state)
        if problem:
            return problem
        keep = mx.array(keep).reshape(-1)
        if keep.size != k.shape[0]:
            return f"keep has {keep.size} entries for {k.shape[0]} sequences"
        return None

    def compare(self, got, want, inputs, params) -> Optional[str]:
        k, v, g, beta, state, keep = inputs
        return mismatch("state", got[0], want[0], atol=state_tolerance(k, want[0], k.shape[1]))

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        q, k, v, g, beta, state = make_inputs(rng, B=3, T=5, Hk=1, Hv=2, Dk=32, Dv=8)
        return (k, v, g, beta, state, mx.array([0, 2, 5], dtype=mx.int32)), {}


VERIFY = GdnVerify()
REPLAY = GdnReplay()

__all__ = ["REPLAY", "VERIFY", "GdnReplay", "GdnVerify", "launch_shape", "make_inputs", "state_tolerance",
           "unsupported_inputs", "y_mismatch"]
