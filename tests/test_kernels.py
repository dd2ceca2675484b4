"""The custom Metal kernels, proven without a Mac: each kernel's own source runs
through the CPU emulation harness and is compared with its pure-MLX reference
(docs/architecture.md, "Kernels"); mutations of the source must be caught; the dispatcher
falls back (and warns once) when a kernel fails its self-check; an environment
variable forces the reference; and the loop stays lossless with the kernels in
it. Emulated kernels are compiled once and cached by source hash.

Tolerances (|kernel - reference| <= atol + rtol |reference|), per output dtype:
  verify_greedy: exact for every logits dtype (argmax and packed result are integers).
  kv_inject values: exact (a copy).
  kv_inject keys: float32 1e-5 / 1e-5 plus RoPE angle rounding
  (4 * position * 2^-24 rad times the largest key); float16 2e-3 / 2e-3 and
  bfloat16 1.6e-2 / 1.6e-2, about 2 units in the last place of the type.
"""

import shutil
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import kernels
from dflash_mlx.loop import acceptance
from dflash_mlx.draft import injection as draft_injection
from dflash_mlx.emulate import EmulationError
from dflash_mlx.kernels import kv_inject as kvi
from dflash_mlx.kernels import verify_greedy as vg
from dflash_mlx.kernels.emulated import emulated_backend, run_kernel
from dflash_mlx.loop.verify import greedy_verify

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")




def emulated(**kw):
    return kernels.use_backend(emulated_backend(**kw))


# ---------------------------------------------------------------- verify_greedy
VERIFY_SHAPES = {  # (B, b, V)
    "V=1": (1, 2, 1),
    "ragged V": (1, 16, 1000),
    "B=3 ragged": (3, 5, 4097),
    "max block": (1, 64, 300),
    "Qwen3 vocab": (2, 16, 151936),
    "Qwen3.5 vocab": (1, 16, 248320),
}


@needs_gxx
@pytest.mark.parametrize("shape", VERIFY_SHAPES.values(), ids=VERIFY_SHAPES.keys())
def test_verify_greedy_matches_reference(shape):
    B, b, V = shape
    rng = np.random.default_rng(V)
    for accept in ([0] * B, [b - 1] * B, None):  # reject at once, accept all, random
        logits, drafted = vg.make_inputs(rng, B, b, V, accept=accept)
        _, problem = run_kernel("verify_greedy", logits, drafted)
        assert problem is None


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("shape", [(2, 16, 151936), (3, 8, 3001)], ids=["V=151936", "ragged"])
def test_verify_greedy_dtypes_and_ties(dtype, shape):
    """Half types and rounded logits repeat the maximum within a row: the
    first index must win, as in mx.argmax."""
    B, b, V = shape
    logits, drafted = vg.make_inputs(np.random.default_rng(b), B, b, V, dtype=dtype, ties=True)
    assert (mx.sum(logits == mx.max(logits, axis=-1, keepdims=True), axis=-1) > 1).any()
    got, problem = run_kernel("verify_greedy", logits, drafted)
    assert problem is None


@needs_gxx
def test_verify_greedy_nan_and_signed_zero_follow_mx_argmax():
    rows = np.array([[-0.0, 0.0, -1.0, -5.0],  # -0 == +0: the first wins
                     [1.0, np.nan, 3.0, np.nan],  # NaN counts as the maximum
                     [-np.inf, -np.inf, -np.inf, -np.inf],
                     [np.inf, 2.0, np.inf, 1.0]], dtype=np.float32)
    logits = mx.array(rows[None])
    drafted = mx.array([[0, 1, 0]], dtype=mx.int32)
    got, problem = run_kernel("verify_greedy", logits, drafted)
    assert problem is None
    assert got[0].tolist() == [[0, 1, 0, 0]]


# ---------------------------------------------------------------- kv_inject
INJECT_SHAPES = {  # B, T, layers, kv heads, head_dim, offset
    "one token hd64": (1, 1, 1, 1, 64, 0),
    "B=2 ragged T hd128": (2, 7, 3, 2, 128, 33),
    "Qwen3.5-9B draft layout": (1, 17, 5, 8, 128, 1000),
    "odd heads partial group hd256": (3, 5, 2, 3, 256, 4095),
    "hd96 ragged lanes": (2, 3, 2, 1, 96, 7),
    "hd16 (test drafts)": (1, 9, 2, 2, 16, 2),
}


@needs_gxx
@pytest.mark.parametrize("shape", INJECT_SHAPES.values(), ids=INJECT_SHAPES.keys())
def test_kv_inject_matches_reference(shape):
    B, T, L, H, D, offset = shape
    inputs, params = kvi.make_inputs(np.random.default_rng(D + T), B=B, T=T, n_layers=L,
                                     n_kv=H, head_dim=D, offset=offset)
    got, problem = run_kernel("kv_inject", *inputs, **params)
    assert problem is None
    assert got[0].shape == (L, B, H, T, D)


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 3, 2, 128, 33), (3, 5, 2, 3, 256, 4095), (1, 4, 2, 2, 64, 9)],
                         ids=["hd128", "hd256", "hd64"])
def test_kv_inject_half_types(dtype, shape):
    B, T, L, H, D, offset = shape
    inputs, params = kvi.make_inputs(np.random.default_rng(3), B=B, T=T, n_layers=L, n_kv=H,
                                     head_dim=D, offset=offset, dtype=dtype)
    _, problem = run_kernel("kv_inject", *inputs, **params)
    assert problem is None


@needs_gxx
def test_kv_inject_scaled_rope_and_large_positions():
    """pos_scale and mscale (linear/yarn/longrope) and a position near 10^5,
    where float32 angles carry rounding of ~position * 2^-24."""
    inputs, params = kvi.make_inputs(np.random.default_rng(4), B=1, T=4, n_layers=2, n_kv=2,
                                     head_dim=128, offset=100_000, base=1e7)
    _, problem = run_kernel("kv_inject", *inputs, **params, pos_scale=0.25, mscale=1.3)
    assert problem is None


# ---------------------------------------------------------------- the tests have teeth
def _verify_case():
    return vg.make_inputs(np.random.default_rng(7), 3, 8, 2000, ties=True), {}


def _inject_case():
    return kvi.make_inputs(np.random.default_rng(8), B=2, T=5, n_layers=2, n_kv=3, head_dim=128, offset=11)


MUTATIONS = [  # kernel, text, replacement, what the mutation breaks
    ("verify_greedy", "if (key > best_key)", "if (key >= best_key)", "first index on ties"),
    ("verify_greedy", "threadgroup_barrier(mem_flags::mem_threadgroup);", "", "barrier"),
    ("verify_greedy", "drafted[seq * (block - 1) + row]", "drafted[seq * block + row]", "draft index"),
    ("verify_greedy", "int((row << 24) | arg)", "int((row << 23) | arg)", "packing"),
    ("verify_greedy", "uint arg = simd_min(key == top ? index : 0xffffffffu);",
     "uint arg = simd_max(key == top ? index : 0u);", "cross-SIMD-group tie break"),
    ("kv_inject", "hi[m] = static_cast<float>(src[j + HALF]);", "hi[m] = static_cast<float>(src[j + HALF - 1]);",
     "rotation partner index"),
    ("kv_inject", "a * sn + c * cs", "a * sn - c * cs", "rotation sign"),
    ("kv_inject", "sum_sq / float(HEAD_DIM)", "sum_sq / float(HALF)", "RMS denominator"),
    ("kv_inject", "static_cast<float>(offset + int(t))", "static_cast<float>(offset)", "absolute position"),
    ("kv_inject", "sum_sq = simd_sum(sum_sq);", "", "SIMD-group reduction"),
    ("kv_inject", "* n_kv + head) * n_tok + t) * HEAD_DIM", "* n_kv) * n_tok + t) * HEAD_DIM", "cache layout"),
]


@needs_gxx
@pytest.mark.parametrize("kernel, text, replacement, what", MUTATIONS, ids=[m[3] for m in MUTATIONS])
def test_a_mutated_kernel_fails_the_comparison(kernel, text, replacement, what):
    source = kernels.get(kernel).source
    assert source.count(text) == 1, f"mutation target not found once in {kernel}: {text}"
    (inputs, params) = _verify_case() if kernel == "verify_greedy" else _inject_case()
    _, problem = run_kernel(kernel, *inputs, **params)
    assert problem is None  # the original passes on this very input
    try:
        _, problem = run_kernel(kernel, *inputs, source=source.replace(text, replacement), **params)
    except EmulationError as e:  # or the harness itself objects (bad memory access, deadlock)
        problem = str(e)
    assert problem is not None, f"mutation '{what}' went unnoticed"


# ---------------------------------------------------------------- dispatch and self-check
class BogusKernel:
    """A 'Metal' kernel that returns zeros of the right shapes: wrong answers."""

    calls = 0

    def __init__(self, **kw):
        pass

    def __call__(self, *, output_shapes, output_dtypes, **kw):
        BogusKernel.calls += 1
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]


def test_reference_without_metal():
    logits, drafted = vg.make_inputs(np.random.default_rng(0), 2, 4, 50)
    assert kernels.current_policy().backend.name == "metal" and not mx.metal.is_available()
    assert vg.KERNEL.reference_reason(logits, drafted) == "no metal backend"
    assert kernels.status() == {name: "reference (no metal backend)" for name in kernels.KERNELS}
    got = greedy_verify(logits, drafted)
    want = acceptance.greedy(logits, drafted)
    assert all(mx.array_equal(g, w) for g, w in zip(got, want))


def test_wrong_kernel_stand_in_warns_once_and_falls_back():
    BogusKernel.calls = 0
    backend = kernels.Backend("bogus", lambda: True, BogusKernel)
    rng = np.random.default_rng(1)
    with kernels.use_backend(backend):
        with pytest.warns(RuntimeWarning, match="'verify_greedy' failed its self-check") as record:
            for _ in range(3):
                logits, drafted = vg.make_inputs(rng, 2, 5, 100)
                got = greedy_verify(logits, drafted)
                want = acceptance.greedy(logits, drafted)
                assert all(mx.array_equal(g, w) for g, w in zip(got, want))
        assert len([w for w in record if "self-check" in str(w.message)]) == 1
        assert BogusKernel.calls == 1  # the self-check only; never used afterwards
        assert vg.KERNEL.status().startswith("disabled by self-check (argmax: ")
        assert not vg.KERNEL.active(logits, drafted)


def test_kernel_that_fails_to_build_falls_back():
    def broken(**kw):
        raise RuntimeError("[metal::Device] Unable to build metal library from source")

    logits, drafted = vg.make_inputs(np.random.default_rng(2), 1, 4, 30)
    with kernels.use_backend(kernels.Backend("broken", lambda: True, broken)):
        with pytest.warns(RuntimeWarning, match="Unable to build metal library"):
            accepted, token = greedy_verify(logits, drafted)
        assert "RuntimeError" in kernels.get("verify_greedy").status()
    assert (accepted.tolist(), token.tolist()) == tuple(x.tolist() for x in acceptance.greedy(logits, drafted))


@needs_gxx
def test_mutated_source_fails_self_check_through_the_emulator():
    """The real self-check path, with a deliberately wrong Metal body."""
    from dflash_mlx import emulate

    def wrong(**kw):
        kw["source"] = kw["source"].replace("int((row << 24) | arg)", "int((row << 24) | (arg + 1))")
        return emulate.metal_kernel(**kw)

    logits, drafted = vg.make_inputs(np.random.default_rng(3), 2, 6, 700)
    with kernels.use_backend(kernels.Backend("emulated-wrong", lambda: True, wrong, {"order": "shuffle"})):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            results = [greedy_verify(logits, drafted) for _ in range(3)]
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "'verify_greedy' failed its self-check (packed: " in messages[0]
    want = acceptance.greedy(logits, drafted)
    for got in results:
        assert all(mx.array_equal(a, b) for a, b in zip(got, want))


@needs_gxx
def test_correct_kernel_passes_self_check_and_runs():
    logits, drafted = vg.make_inputs(np.random.default_rng(4), 2, 16, 5000)
    with emulated():
        assert vg.KERNEL.active(logits, drafted)
        assert {k: kernels.get(k).status() for k in ("kv_inject", "verify_greedy")} == \
            {"kv_inject": "active", "verify_greedy": "active"}
        got = greedy_verify(logits, drafted)
        # shapes outside the kernel's range go to the reference
        big = mx.zeros((1, 65, 10))
        assert vg.KERNEL.reference_reason(big, mx.zeros((1, 64), mx.int32)) == "block of 65 (kernel: 2..64)"
    want = acceptance.greedy(logits, drafted)
    assert all(mx.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.filterwarnings("ignore:dflash-mlx.*failed its self-check")
@pytest.mark.parametrize("value, forced", [("1", None), ("all", None),  # None: every registered kernel
                                           ("verify_greedy", {"verify_greedy"}), ("kv_inject, other", {"kv_inject"}),
                                           ("0", set())])
def test_environment_variable_forces_the_reference(monkeypatch, value, forced):
    BogusKernel.calls = 0
    forced = set(kernels.KERNELS) if forced is None else forced
    monkeypatch.setenv(kernels.REFERENCE_ENV, value)
    policy = kernels.KernelPolicy.from_env(backend=kernels.Backend("spy", lambda: True, BogusKernel))
    monkeypatch.delenv(kernels.REFERENCE_ENV)  # read once, when the policy is made
    with kernels.use_policy(policy):
        for name, kernel in kernels.KERNELS.items():
            inputs, params = kernel.sample(np.random.default_rng(0))
            reason = kernel.reference_reason(*inputs, **params)
            if name in forced:
                assert reason == f"forced by {kernels.REFERENCE_ENV}"
                assert kernel.status() == f"reference (forced by {kernels.REFERENCE_ENV})"
            else:
                assert reason is not None and reason.startswith("disabled by self-check")
    # forced kernels are never built or run, not even for a self-check
    assert BogusKernel.calls == len(kernels.KERNELS) - len(forced)


# ---------------------------------------------------------------- the draft's injection path
def _draft(rope_scaling=None, n_layers=3, head_dim=16, seed=0, **overrides):
    from dflash_mlx import DFlashDraft, DraftConfig

    cfg = dict(
        hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, intermediate_size=48, vocab_size=64, num_target_layers=6,
        rms_norm_eps=1e-6, dflash_config={"block_size": 4, "mask_token_id": 63, "target_layer_ids": [1, 4]},
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, max_position_embeddings=4096,
    )
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    cfg.update(overrides)
    draft = DFlashDraft(DraftConfig.from_dict(cfg))
    rng = np.random.default_rng(seed)
    draft.load_weights([(k, mx.array(rng.normal(0, 0.3, v.shape) + (v.ndim == 1), dtype=mx.float32))
                        for k, v in tree_flatten(draft.parameters())])
    return draft


def _per_layer(draft, ctx, offset):
    ks, vs = zip(*(layer.self_attn.keys_values(ctx, offset) for layer in draft.layers))
    return mx.stack(ks), mx.stack(vs)


def _injected(draft, features, chunks=(2,)):
    """Cache contents after injecting `features` in chunks, through draft.inject."""
    cache = draft.make_cache()
    start = 0
    for size in list(chunks) + [features.shape[1]]:
        if start < features.shape[1]:
            draft.inject(features[:, start:start + size], cache)
            start += size
    return [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache]


def _per_layer_injected(draft, features):
    ctx = draft.hidden_norm(draft.fc(features))
    k, v = _per_layer(draft, ctx, 0)
    return [(k[i], v[i]) for i in range(k.shape[0])]


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0] * 8, "long_factor": [1.0 + 0.1 * i for i in range(8)]},
}


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_stacked_injection_equals_layer_by_layer(rope):
    draft = _draft(rope)
    assert draft_injection.plan_reason(draft)[1] is None
    features = mx.array(np.random.default_rng(5).normal(size=(2, 9, 64)), dtype=mx.float32)
    got = _injected(draft, features, chunks=(1, 3))
    want = _per_layer_injected(draft, features)
    for (gk, gv), (wk, wv) in zip(got, want):
        np.testing.assert_allclose(np.array(gk), np.array(wk), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(gv), np.array(wv), rtol=1e-5, atol=1e-6)


def test_unsupported_rope_falls_back_with_its_reason():
    draft = _draft({"rope_type": "dynamic", "factor": 2.0})
    features = mx.array(np.random.default_rng(6).normal(size=(1, 5, 64)), dtype=mx.float32)
    with pytest.warns(RuntimeWarning, match="layer by layer .*DynamicNTKScalingRoPE"):
        got = _injected(draft, features)
    # the layer-by-layer path over the chunks _injected feeds (2, then 3 positions): the
    # same matmul shapes, so bit-identical whatever BLAS MLX uses (OpenBLAS rounds a row
    # differently in a matrix with another number of rows)
    chunks = [_per_layer(draft, draft.hidden_norm(draft.fc(features[:, s:e])), s) for s, e in ((0, 2), (2, 5))]
    want_k, want_v = (mx.concatenate(parts, axis=-2) for parts in zip(*chunks))
    for i, (gk, gv) in enumerate(got):
        assert mx.array_equal(gk, want_k[i]) and mx.array_equal(gv, want_v[i])
    draft.layers[0].self_attn.rope = nn.RoPE(16, traditional=True)
    assert "traditional" in draft_injection.plan_reason(draft)[1]


def test_stacking_keeps_parameters_and_follows_new_weights():
    draft = _draft()
    before = {k: np.array(v) for k, v in tree_flatten(draft.parameters())}
    features = mx.array(np.random.default_rng(7).normal(size=(1, 4, 64)), dtype=mx.float32)
    _injected(draft, features)
    after = dict(tree_flatten(draft.parameters()))
    assert set(after) == set(before)
    for k, v in after.items():
        np.testing.assert_array_equal(np.array(v), before[k])
    plan = draft.injection_plan
    assert len(plan.groups) == 1  # one matmul for all layers' K and V
    # new weights (e.g. load_weights) invalidate the stacked copy
    fresh = _draft(seed=9)
    draft.load_weights(list(tree_flatten(fresh.parameters())))
    got = _injected(draft, features)
    want = _per_layer_injected(fresh, features)
    for (gk, _), (wk, _) in zip(got, want):
        np.testing.assert_allclose(np.array(gk), np.array(wk), rtol=1e-5, atol=1e-5)
    assert draft.injection_plan is not plan


@pytest.mark.parametrize("mixed", [False, True], ids=["4-bit", "mixed 4/8-bit"])
def test_quantized_draft_uses_stacked_quantized_matmuls(mixed):
    draft = _draft(head_dim=32, intermediate_size=64)
    if mixed:  # the last layer at 8 bits, as the mixed_4_8 recipe: two stacked groups
        nn.quantize(draft, group_size=32, bits=4,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and not p.startswith("layers.2"))
        nn.quantize(draft, group_size=32, bits=8,
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and p.startswith("layers.2"))
    else:
        nn.quantize(draft, group_size=32, bits=4)
    features = mx.array(np.random.default_rng(8).normal(size=(1, 6, 64)), dtype=mx.float32)
    got = _injected(draft, features)
    want = _per_layer_injected(draft, features)
    plan = draft.injection_plan
    assert len(plan.groups) == (2 if mixed else 1)
    for (gk, gv), (wk, wv) in zip(got, want):
        np.testing.assert_allclose(np.array(gk), np.array(wk), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(gv), np.array(wv), rtol=1e-5, atol=1e-5)


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_draft_injection_through_the_emulated_kernel(dtype):
    draft = _draft(head_dim=64)
    draft.set_dtype(dtype)
    features = mx.array(np.random.default_rng(9).normal(size=(2, 7, 64))).astype(dtype)
    want = _injected(draft, features, chunks=(3,))
    with emulated():
        got = _injected(draft, features, chunks=(3,))
        assert kvi.KERNEL.status() == "active"
    rtol, atol = kernels.registry.TOLERANCES[dtype]
    for (gk, gv), (wk, wv) in zip(got, want):
        assert mx.array_equal(gv, wv)
        np.testing.assert_allclose(np.array(gk.astype(mx.float32)), np.array(wk.astype(mx.float32)),
                                   rtol=rtol, atol=atol)


# ---------------------------------------------------------------- the loop with kernels in it
@needs_gxx
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_loop_is_lossless_with_emulated_kernels(target_dirs, draft_dir, family):
    """Generation with both kernels active (emulated) equals the reference path."""
    from mlx_lm import load as mlx_lm_load

    from dflash_mlx import generate, load_draft

    model, tokenizer = mlx_lm_load(str(target_dirs[family]))
    draft = load_draft(str(draft_dir(family, block_size=8)))
    prompt = "write a short story about a cat who"
    want = generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=8).tokens
    launches = {}
    from dflash_mlx import emulate

    def counting(**kw):
        inner = emulate.metal_kernel(**kw)

        def call(**args):
            launches[kw["name"]] = launches.get(kw["name"], 0) + 1
            return inner(**args)
        return call

    with kernels.use_backend(kernels.Backend("emulated-counting", lambda: True, counting)):
        got = generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=8).tokens
        assert {k: kernels.get(k).status() for k in ("kv_inject", "verify_greedy")} == \
            {"kv_inject": "active", "verify_greedy": "active"}
    assert got == want
    assert launches["verify_greedy"] > 1 and launches["kv_inject"] > 1
