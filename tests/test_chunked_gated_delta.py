"""The chunked gated delta rule used to train targets (train/chunked_gated_delta).

- ``chunked_gated_delta`` equals mlx-lm's ``gated_delta_ops`` (outputs, final
  state, and gradients w.r.t. every input and the initial state) within float32
  tolerance, over ragged lengths, chunk sizes, GQA repeats and strong decays;
- its triangular solve stays exact where a Neumann series would blow up;
- ``training_logits`` is ``model(x)`` of a qwen3_5 model in train mode, values
  and parameter gradients, and refuses other models.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3_5
from mlx_lm.models.gated_delta import gated_delta_ops

from dflash_mlx.train.chunked_gated_delta import chunked_gated_delta, training_logits, unit_lower_inverse


def make_inputs(seed, B=2, T=64, Hk=2, Hv=4, Dk=16, Dv=32, strongest=30.0):
    """Normalized q, k (scale folded into q), gates from about 1 down to
    exp(-strongest) (half of them mild), beta in (0, 1), a nonzero state."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, Hk, Dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(Dk)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, Dv))
    strong = rng.uniform(-strongest, 0, (B, T, Hv)) * (rng.uniform(size=(B, T, Hv)) < 0.5)
    g = np.exp(strong + rng.uniform(-0.2, 0, (B, T, Hv)))
    beta = rng.uniform(0, 1, (B, T, Hv))
    state = rng.standard_normal((B, Hv, Dv, Dk))
    return [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta, state)]


def assert_close(got, want, tol, what=""):
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape, what
    scale = max(np.abs(want).max(), 1e-6)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


@pytest.mark.parametrize("T", [1, 5, 64, 100, 130])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_matches_mlx_lm_recurrence(T, chunk):
    for seed, dims in enumerate([(16, 32), (32, 32)]):
        q, k, v, g, beta, state = make_inputs(seed, T=T, Dk=dims[0], Dv=dims[1])
        want_y, want_s = gated_delta_ops(q, k, v, g, beta, state)
        y, s = chunked_gated_delta(q, k, v, g, beta, state, chunk=chunk)
        assert y.dtype == mx.float32 and s.dtype == mx.float32
        assert_close(y, want_y, 1e-5, "y")
        assert_close(s, want_s, 1e-5, "state")
    y, s = chunked_gated_delta(q, k, v, g, beta, None, chunk=chunk)  # no state: zeros
    want_y, want_s = gated_delta_ops(q, k, v, g, beta, None)
    assert_close(y, want_y, 1e-5, "y from zeros")
    assert_close(s, want_s, 1e-5, "state from zeros")


def test_extreme_gates_stay_finite_and_exact():
    """Gates down to exp(-40) and exactly 0 (compute_g can underflow): no inf or
    nan, and the state is wiped as mlx-lm's is."""
    q, k, v, g, beta, state = make_inputs(3, T=100, strongest=40.0)
    g = mx.where(mx.arange(100)[None, :, None] % 17 == 3, 0.0, g)
    want_y, want_s = gated_delta_ops(q, k, v, g, beta, state)
    y, s = chunked_gated_delta(q, k, v, g, beta, state, chunk=64)
    assert_close(y, want_y, 1e-5, "y")
    assert_close(s, want_s, 1e-5, "state")
    argnums = tuple(range(6))
    want = mx.grad(lambda *a: gated_delta_ops(*a)[0].sum(), argnums)(q, k, v, g, beta, state)
    got = mx.grad(lambda *a: chunked_gated_delta(*a)[0].sum(), argnums)(q, k, v, g, beta, state)
    assert all(mx.isfinite(t).all().item() for t in got)
    for name, w, o in zip(["q", "k", "v", "g", "beta", "state"], want, got):
        if name == "g":  # 0 below GATE_FLOOR (where d/dx of g = exp(x) is ~0 anyway)
            w, o = (mx.where(g > 1e-30, t, 0.0) for t in (w, o))
        assert_close(o, w, 1e-4, f"d/d{name}")


@pytest.mark.parametrize("T,chunk", [(5, 16), (100, 32), (130, 64)])
def test_gradients_match_mlx_lm_recurrence(T, chunk):
    args = make_inputs(10 + T, T=T)
    rng = np.random.default_rng(T)
    ry = mx.array(rng.standard_normal((2, T, 4, 32)).astype(np.float32))
    rs = mx.array(rng.standard_normal((2, 4, 32, 16)).astype(np.float32))

    def functional(fn):
        def f(*a):
            y, s = fn(*a)
            return (y * ry).sum() + (s * rs).sum()
        return f

    argnums = tuple(range(6))
    want = mx.grad(functional(gated_delta_ops), argnums)(*args)
    got = mx.grad(functional(lambda *a: chunked_gated_delta(*a, chunk=chunk)), argnums)(*args)
    for name, w, o in zip(["q", "k", "v", "g", "beta", "state"], want, got):
        assert_close(o, w, 1e-4, f"d/d{name}")


def test_triangular_solve_is_stable():
    """Equal keys with beta near 1 and no decay: (I + A)^-1 is bidiagonal, but
    powers of A reach ~1e17, which (I - A)(I + A^2)(I + A^4)... cancels."""
    C = 64
    a = np.tril(np.full((C, C), 0.98, np.float32), -1)
    want = np.linalg.inv(np.eye(C) + a.astype(np.float64))
    assert_close(unit_lower_inverse(mx.array(a)), want, 1e-5)
    rng = np.random.default_rng(0)
    a = np.tril(rng.uniform(-1, 1, (3, 16, 16)).astype(np.float32), -1)
    assert_close(unit_lower_inverse(mx.array(a)), np.linalg.inv(np.eye(16) + a.astype(np.float64)), 1e-5)
    k = mx.ones((1, C, 1, 16)) / 4.0  # the same key at every step
    q, v = k / 4.0, mx.array(rng.standard_normal((1, C, 1, 8)).astype(np.float32))
    ones = mx.ones((1, C, 1))
    want_y, want_s = gated_delta_ops(q, k, v, ones, ones * 0.99)
    y, s = chunked_gated_delta(q, k, v, ones, ones * 0.99)
    assert_close(y, want_y, 1e-5, "y")
    assert_close(s, want_s, 1e-5, "state")


def tiny_qwen3_5(tie: bool):
    mx.random.seed(0)
    text = {
        "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "vocab_size": 97, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    }
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text,
                                                       "tie_word_embeddings": tie}))
    model.set_dtype(mx.float32)
    model.train()
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_training_logits_is_the_models_forward(tie):
    model = tiny_qwen3_5(tie)
    x = mx.array(np.random.default_rng(1).integers(0, 97, (2, 41)))
    targets = mx.array(np.random.default_rng(2).integers(0, 97, (2, 41)))
    assert_close(training_logits(model, x, chunk=16), model(x), 1e-4, "logits")
    assert_close(training_logits(model, x[:, :1]), model(x[:, :1]), 1e-4, "one token")

    def loss(forward):
        return lambda m: nn.losses.cross_entropy(forward(m, x), targets, reduction="mean")

    want = dict(tree_flatten(nn.value_and_grad(model, loss(lambda m, t: m(t)))(model)[1]))
    got = dict(tree_flatten(nn.value_and_grad(model, loss(lambda m, t: training_logits(m, t, 16)))(model)[1]))
    assert got.keys() == want.keys()
    assert any("linear_attn.A_log" in name for name in got)
    for name in want:
        assert_close(got[name], want[name], 2e-4, name)


def test_other_models_are_refused():
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=50, num_key_value_heads=2)
    with pytest.raises(ValueError, match="qwen3_5"):
        training_logits(llama.Model(args), mx.zeros((1, 4), dtype=mx.int32))
    with pytest.raises(ValueError, match="qwen3_5"):
        training_logits(nn.Linear(4, 4), mx.zeros((1, 4), dtype=mx.int32))
