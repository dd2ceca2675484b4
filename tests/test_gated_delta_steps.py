"""The GatedDeltaNet recurrence where no Metal kernel runs (gated_delta_steps)
and the rollback that reuses the verify pass's states (gated_delta.restore).

- ``steps`` is bit for bit mlx-lm's ``gated_delta_ops`` (outputs and final
  state), and each kept state is the state after that many steps, over dtypes,
  GQA repeats, ragged sizes and blocks of 1..16; it builds about a third fewer graph nodes.
- Rollback of a verified block at every kept length is bit-identical to
  mlx-lm's recurrence over the kept steps, and its structure is what the
  design says: no recurrence step at a checkpoint, at most CHECKPOINT_EVERY - 1
  otherwise (counted in the graph it builds, not timed).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_ops, gated_delta_update

from dflash_mlx import Target
from dflash_mlx.bench.rollback_cost import graph_ops
from dflash_mlx.targets.gated_delta import restore, restore_rows
from dflash_mlx.targets.gated_delta_steps import CHECKPOINT_EVERY, steps
from dflash_mlx.kernels.gdn import make_inputs

SHAPES = {  # (B, T, Hk, Hv, Dk, Dv)
    "qwen3.5-9B heads b16": (1, 16, 16, 32, 128, 128),
    "GQA2 b16": (1, 16, 2, 4, 32, 32),
    "B2 b5": (2, 5, 2, 4, 32, 16),
    "b1": (1, 1, 1, 2, 64, 8),
    "GQA3 ragged Dv b7": (3, 7, 1, 3, 64, 13),
}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_steps_is_mlx_lm_ops_path_bit_for_bit(shape, dtype):
    B, T, Hk, Hv, Dk, Dv = shape
    for seed in range(2):
        q, k, v, g, beta, state = make_inputs(np.random.default_rng(seed), B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv,
                                              dtype=dtype)
        want_y, want_state = gated_delta_ops(q, k, v, g, beta, state)
        for every in (1, 2, 3, T):
            y, states = steps(q, k, v, g, beta, state, every)
            assert y.dtype == want_y.dtype and mx.array_equal(y, want_y).item(), f"y, every {every}"
            ends = [*range(every, T + 1, every)] + ([T] if T % every else [])
            assert len(states) == len(ends)
            for end, kept in zip(ends, states):
                _, want = gated_delta_ops(q[:, :end], k[:, :end], v[:, :end], g[:, :end], beta[:, :end], state)
                assert mx.array_equal(kept, want).item(), f"state after {end} steps, every {every}"
            assert mx.array_equal(states[-1], want_state).item()


def test_steps_builds_fewer_graph_nodes():
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(0), B=1, T=16, Hk=2, Hv=4, Dk=32, Dv=32)
    mx.eval(q, k, v, g, beta, state)
    y, states = steps(q, k, v, g, beta, state)
    ours = sum(graph_ops(y, *states).values())
    theirs = sum(graph_ops(*gated_delta_ops(q, k, v, g, beta, state)).values())
    assert ours <= 0.75 * theirs, (ours, theirs)  # about 16 nodes a step against about 24


def test_vector_gating_is_refused():
    q, k, v, g, beta, state = make_inputs(np.random.default_rng(0), B=1, T=2, Hk=1, Hv=2, Dk=32, Dv=8)
    with pytest.raises(ValueError, match="scalar gating"):
        steps(q, k, v, mx.ones((1, 2, 2, 32)), beta, state)


# ---------------------------------------------------------------- rollback
def _verified_block(block: int, rows: int = 1):
    """A tiny qwen3_5 target after a prompt and one recorded block (evaluated),
    for ``rows`` requests side by side (row r's tokens shifted by r)."""
    from checkpoints import build_target

    model, _ = build_target("qwen3_5", seed=3)
    model.eval()
    target = Target(model)
    cache = target.make_cache()
    prompt, tokens = [5, 17, 3, 99], [7, 1, 42, 8, 13, 2, 64, 11, 9][:block]
    target.forward(mx.array([[t + r for t in prompt] for r in range(rows)]), cache, [0])
    forward = target.forward(mx.array([[t + r for t in tokens] for r in range(rows)]), cache, [0], record=True)
    mx.eval(forward.hidden, [c.state for c in cache], [r.states for r in forward.records if r is not None])
    return cache, forward


@pytest.mark.parametrize("block", [5, 9])
def test_rollback_selects_a_kept_state_and_replays_at_most_every_minus_one_steps(block):
    cache, forward = _verified_block(block)
    linear = [(i, r) for i, r in enumerate(forward.records) if r is not None]
    assert linear and all(r.states is not None and r.every == CHECKPOINT_EVERY for _, r in linear)
    for keep in range(block + 1):
        for i, r in linear:
            rolled = ArraysCache(2)
            rolled.cache = list(cache[i].cache)
            restore(rolled, r, keep)
            state = rolled[1]
            if keep % r.every == 0:  # a kept state, or the one before the block
                assert state is (r.states[keep // r.every - 1] if keep else r.state), f"keep {keep}"
            assert graph_ops(state)["Sum"] == keep % r.every, f"keep {keep}: recurrence steps replayed"
            gdn = r.layer  # what rollback replayed before: mlx-lm's recurrence over the kept steps
            want = r.state if keep == 0 else gated_delta_update(
                *(t[:, :keep] for t in (r.q, r.k, r.v, r.a, r.b)), gdn.A_log, gdn.dt_bias, r.state, None,
                use_kernel=False)[1]
            assert mx.array_equal(state, want).item(), f"layer {i}, keep {keep}"
            assert mx.array_equal(rolled[0], r.conv_input[:, keep : keep + 3]).item()


def test_rollback_cost_bench_on_a_tiny_hybrid():
    from dflash_mlx.bench.rollback_cost import rollback_costs
    from dflash_mlx.bench.synthetic import hybrid_target

    tiny = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                linear_key_head_dim=32, linear_value_head_dim=16, vocab_size=256)
    result = rollback_costs(hybrid_target(**tiny), block=4)
    assert result["gated_delta_layers"] == 3 and result["checkpoint_every"] == CHECKPOINT_EVERY
    assert [r["keep"] for r in result["rows"]] == [1, 2, 3]
    assert all(r["rollback_ms"] > 0 and r["replay_from_start_ms"] > 0 for r in result["rows"])
    assert result["t_ar_ms"] > 0 and result["t_verify_ms"] > 0
    rec = result["recurrence"]
    assert rec["steps_nodes"] < rec["mlx_lm_nodes"]


@pytest.mark.parametrize("block", [5, 8])
def test_rows_roll_back_each_to_its_own_restore_in_one_batched_replay(block):
    """A batch's rows, each keeping its own count, get bit for bit the state and
    conv window ``restore`` gives that row alone; the steps after the rows'
    kept states are replayed once for the batch, not once per row."""
    cache, forward = _verified_block(block, rows=3)
    linear = [(i, r) for i, r in enumerate(forward.records) if r is not None]
    for a in range(block + 1):
        for b in range(block + 1):
            keeps = [a, b, (a + 2 * b) % (block + 1)]
            for i, r in linear:
                rolled = ArraysCache(2)
                rolled.cache = list(cache[i].cache)
                restore_rows(rolled, r, keeps)
                if len(set(keeps)) > 1:
                    assert graph_ops(rolled[1])["Sum"] <= r.every - 1, f"keeps {keeps}: steps replayed per row"
                for row, keep in enumerate(keeps):
                    alone = ArraysCache(2)
                    restore(alone, r.row(row), keep)
                    assert mx.array_equal(rolled[1][row : row + 1], alone[1]).item(), f"layer {i}, keeps {keeps}"
                    assert mx.array_equal(rolled[0][row : row + 1], alone[0]).item(), f"layer {i}, keeps {keeps}"
