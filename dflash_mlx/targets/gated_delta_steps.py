"""The GatedDeltaNet recurrence where no Metal kernel runs, keeping checkpoints.

``steps`` computes what mlx-lm's ``gated_delta_ops`` computes (scalar gating,
no mask) with the same compiled step, so outputs and states are bit-identical
to it (``tests/test_gated_delta_steps.py`` checks this with ``mx.array_equal``
over dtypes and shapes). It differs in the graph it builds around the step:
each tensor is laid out time-major once per block and split into its steps in
one operation, so no step slices, squeezes or expands its inputs: about 16
graph nodes a step instead of about 24, and less Python per step.

It also returns the state after every ``every`` steps: the verify pass keeps
them, and rollback starts from the last one at or before the kept length
(``gated_delta.restore``).
"""

import mlx.core as mx

CHECKPOINT_EVERY = 2
"""Steps between kept states in a verified block: rollback replays at most
CHECKPOINT_EVERY - 1 steps (docs/architecture.md, "Rollback", for the memory)."""


@mx.compile
def _step(q, k, v, g, beta, state):
    """mlx-lm's ``_gated_delta_step_ops`` (scalar gating) on inputs shaped to
    broadcast against the state [B, Hv, Dv, Dk]: q, k [B, Hv, 1, Dk], v [B, Hv, Dv],
    g [B, Hv, 1, 1], beta [B, Hv, 1]."""
    state = state * g
    kv_mem = (state * k).sum(axis=-1)
    delta = (v - kv_mem) * beta
    state = state + k * delta[..., None]
    return (state * q).sum(axis=-1), state


def _per_step(x: mx.array, shape: tuple) -> list[mx.array]:
    """x [B, T, ...] as T arrays [B, *shape]: one split of a time-major copy."""
    B, T = x.shape[:2]
    time_major = x if B == 1 else mx.contiguous(mx.moveaxis(x, 1, 0))
    time_major = time_major.reshape(T * B, *shape)
    return mx.split(time_major, T) if T > 1 else [time_major]


def steps(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
          every: int = CHECKPOINT_EVERY) -> tuple[mx.array, list[mx.array]]:
    """(y [B, T, Hv, Dv], states): q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g and
    beta [B, T, Hv], state [B, Hv, Dv, Dk] float32; ``states`` are the states
    after every, 2*every, ... steps, and after the last step."""
    if g.ndim != 3:
        raise ValueError(f"scalar gating only: g must be [B, T, Hv], got {tuple(g.shape)}")
    T, Hk, Hv = k.shape[1], k.shape[2], v.shape[2]
    if Hv > Hk:  # as gated_delta_ops repeats the key heads
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    Dk, Dv = k.shape[3], v.shape[3]
    shapes = ((Hv, 1, Dk), (Hv, 1, Dk), (Hv, Dv), (Hv, 1, 1), (Hv, 1))
    ys, states = [], []
    for t, inputs in enumerate(zip(*(_per_step(x, shape) for x, shape in zip((q, k, v, g, beta), shapes)))):
        y, state = _step(*inputs, state)
        ys.append(y)
        if (t + 1) % every == 0 or t == T - 1:
            states.append(state)
    return mx.stack(ys, axis=1).astype(q.dtype), states
