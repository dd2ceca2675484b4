"""GatedDeltaNet verify-and-rollback kernels (metal/gdn_verify.metal,
metal/gdn_replay.metal), proven without a Mac.

- The kernels' own sources, emulated, against mlx-lm's ops path
  (``gated_delta_ops``, what ``gated_delta_update`` runs on CPU) on fresh random
  inputs made as a qwen3_5 layer makes them: Dk, Dv in {32, 64, 128}; Hv != Hk
  (GQA-style repeats); B > 1; blocks b in {1, 4, 16}; every rollback length
  0..b, all in one replay launch (one sequence per length).
- Replay is bit-identical to the state the verify kernel passed through.
- Mutations of either source fail the comparison.
- In the loop (kernels emulated behind the real dispatch): rollback at every
  acceptance length leaves the caches as a fresh prefill does, and greedy output
  is token-identical to mlx-lm, on a float32 and on a 4-bit quantized qwen3_5
  target (there with the quantized matmul kernel too).
- On-device parity (``-m metal``): only where Metal exists.

Tolerances. States (float32): |kernel - reference| <= 4 Dk T 2^-24 max(1,
max|state|): each step has two Dk-term float sums that another summation order
may round differently. y: that plus 4 ulp (float32) or 2 ulp (float16,
bfloat16) of its dtype relative to |y|, for the final rounding to the input
dtype. Replay against the verify kernel: exact.
"""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache

from dflash_mlx import Target, kernels
from dflash_mlx.targets import RowKVCache
from dflash_mlx.targets import gated_delta as gd_adapter
from dflash_mlx.loop.decoder import SpeculativeDecoder
from dflash_mlx.emulate import EmulationError, metal_kernel
from dflash_mlx.kernels.emulated import emulated_backend, run_kernel
from dflash_mlx.kernels import gdn

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")




def emulated(**kw):
    return kernels.use_backend(emulated_backend(**kw))


# ---------------------------------------------------------------- verify vs reference
SHAPES = {  # (B, T, Hk, Hv, Dk, Dv)
    "Dk128 Dv32 GQA2 b16": (2, 16, 2, 4, 128, 32),
    "Dk64 Dv64 GQA3 b4": (3, 4, 1, 3, 64, 64),
    "Dk32 Dv128 b1": (2, 1, 2, 2, 32, 128),
    "Dk32 Dv64 GQA2 b16": (1, 16, 1, 2, 32, 64),
    "Dk128 Dv128 b4": (2, 4, 2, 4, 128, 128),
    "ragged Dv": (2, 4, 1, 2, 64, 13),
}


@needs_gxx
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_verify_matches_mlx_lm(shape):
    B, T, Hk, Hv, Dk, Dv = shape
    inputs = gdn.make_inputs(np.random.default_rng(sum(shape)), B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv)
    _, problem = run_kernel("gdn_verify", *inputs)
    assert problem is None, problem


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 2, 4, 64, 32), (1, 4, 1, 2, 128, 16)], ids=["b16", "b4"])
def test_verify_half_types(dtype, shape):
    B, T, Hk, Hv, Dk, Dv = shape
    inputs = gdn.make_inputs(np.random.default_rng(T), B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype)
    (y, state), problem = run_kernel("gdn_verify", *inputs, order="reverse")
    assert problem is None, problem
    assert y.dtype == dtype and state.dtype == mx.float32


@needs_gxx
def test_verify_long_decay_from_a_large_state():
    """A state that already carries a long context (large entries), and gates near 1."""
    inputs = list(gdn.make_inputs(np.random.default_rng(9), B=2, T=16, Hk=1, Hv=2, Dk=64, Dv=16,
                                  state_scale=30.0))
    inputs[3] = mx.minimum(inputs[3] ** 0.01, 1.0)  # g close to 1: little decay
    _, problem = run_kernel("gdn_verify", *inputs)
    assert problem is None, problem


# ---------------------------------------------------------------- replay at every length
@needs_gxx
@pytest.mark.parametrize("b", [1, 4, 16])
@pytest.mark.parametrize("dims", [(1, 2, 32, 64), (2, 4, 64, 32), (1, 1, 128, 128)],
                         ids=["Dk32-Dv64", "Dk64-Dv32", "Dk128-Dv128"])
def test_replay_every_rollback_length_in_one_launch(b, dims):
    """Sequence s of a batch of b+1 copies keeps s steps: every length 0..b at
    once, against the reference and bit for bit against the verify kernel run
    on the first s steps."""
    Hk, Hv, Dk, Dv = dims
    rng = np.random.default_rng(b * Dk)
    q, k, v, g, beta, state = gdn.make_inputs(rng, B=1, T=b, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv)
    copies = b + 1
    tile = lambda x: mx.repeat(x, copies, axis=0)  # noqa: E731
    keep = mx.arange(copies, dtype=mx.int32)
    (got,), problem = run_kernel("gdn_replay", tile(k), tile(v), tile(g), tile(beta), tile(state), keep,
                                 order="reverse")
    assert problem is None, problem
    for s in range(copies):
        if s == 0:
            want = state[0]
        else:
            (_, verified), problem = run_kernel("gdn_verify", q[:, :s], k[:, :s], v[:, :s], g[:, :s],
                                                beta[:, :s], state)
            assert problem is None
            want = verified[0]
        assert mx.array_equal(got[s], want).item(), f"keep {s}: replay differs from the verify pass"


@needs_gxx
def test_replay_per_sequence_lengths_and_clamping():
    q, k, v, g, beta, state = gdn.make_inputs(np.random.default_rng(3), B=4, T=5, Hk=1, Hv=2, Dk=32, Dv=8)
    keep = mx.array([3, 0, 5, 2], dtype=mx.int32)
    _, problem = run_kernel("gdn_replay", k, v, g, beta, state, keep)
    assert problem is None
    (clamped,), _ = run_kernel("gdn_replay", k, v, g, beta, state, mx.array([9, -2, 5, 0], dtype=mx.int32),
                               compare=False)
    (plain,), _ = run_kernel("gdn_replay", k, v, g, beta, state, mx.array([5, 0, 5, 0], dtype=mx.int32),
                             compare=False)
    assert mx.array_equal(clamped, plain).item()


# ---------------------------------------------------------------- mutations
VERIFY_MUTATIONS = [
    ("s[j] = s[j] * decay;", "s[j] = s[j];", "decay dropped"),
    ("(v_[row] - kv) * beta_[hv]", "(v_[row] - kv)", "beta dropped"),
    ("  kv += simd_shuffle_xor(kv, 16);\n", "", "butterfly level 16 (kv)"),
    ("  out += simd_shuffle_xor(out, 4);\n", "", "butterfly level 4 (y)"),
    ("const int hk = hv / (Hv / Hk);", "const int hk = hv % Hk;", "GQA head mapping"),
    ("s[j] = s[j] + k_[PER_LANE * lane + j] * delta;", "s[j] = s[j] + q_[PER_LANE * lane + j] * delta;",
     "update with q"),
    ("  v_ += Hv * Dv;\n", "", "v not advanced"),
    ("state_out[state_at + j] = s[j];", "state_out[state_at + j] = state[state_at + j];", "final state"),
]
REPLAY_MUTATIONS = [
    ("const int steps = min(max(int(keep[seq]), 0), T);", "const int steps = T;", "keep ignored"),
    ("int(keep[seq])", "int(keep[0])", "keep of the wrong sequence"),
    ("for (int t = 0; t < steps; ++t)", "for (int t = 0; t + 1 < steps; ++t)", "one step short"),
    ("(v_[row] - kv) * beta_[hv]", "(v_[row] - kv) * beta_[0]", "beta of head 0"),
]


@needs_gxx
@pytest.mark.parametrize("kernel, text, replacement, what",
                         [("gdn_verify", *m) for m in VERIFY_MUTATIONS] + [("gdn_replay", *m) for m in REPLAY_MUTATIONS],
                         ids=[m[2] for m in VERIFY_MUTATIONS + REPLAY_MUTATIONS])
def test_a_mutated_kernel_fails_the_comparison(kernel, text, replacement, what):
    source = kernels.get(kernel).source
    assert source.count(text) == 1, f"mutation target not found once in {kernel}: {text}"
    q, k, v, g, beta, state = gdn.make_inputs(np.random.default_rng(11), B=3, T=6, Hk=2, Hv=4, Dk=64, Dv=8)
    inputs = (q, k, v, g, beta, state) if kernel == "gdn_verify" else \
        (k, v, g, beta, state, mx.array([4, 1, 6], dtype=mx.int32))
    _, problem = run_kernel(kernel, *inputs)
    assert problem is None
    try:
        _, problem = run_kernel(kernel, *inputs, source=source.replace(text, replacement))
    except EmulationError as e:
        problem = str(e)
    assert problem is not None, f"mutation '{what}' went unnoticed"


# ---------------------------------------------------------------- dispatch
def test_uncovered_inputs_go_to_the_reference_with_a_reason():
    q, k, v, g, beta, state = gdn.make_inputs(np.random.default_rng(0), B=1, T=2, Hk=1, Hv=2, Dk=32, Dv=8)
    why = gdn.VERIFY.unsupported
    assert why(q, k, v, g, beta, state) is None
    q48, k48, _, _, _, _ = gdn.make_inputs(np.random.default_rng(0), B=1, T=2, Hk=1, Hv=2, Dk=48, Dv=8)
    assert why(q48, k48, v, g, beta, mx.zeros((1, 2, 8, 48))) == "Dk = 48 (kernel: a multiple of 32 up to 256)"
    vector_g = mx.ones((1, 2, 2, 32))
    assert why(q, k, v, vector_g, beta, state).startswith("g must be [B, T, Hv] float32 (vector gating")
    assert why(q, k, v, g, beta, state.astype(mx.bfloat16)) == "state must be [B, Hv, Dv, Dk] float32"
    assert gdn.REPLAY.unsupported(k, v, g, beta, state, mx.array([1, 2], dtype=mx.int32)) == \
        "keep has 2 entries for 1 sequences"


@needs_gxx
def test_self_checks_pass_in_the_emulator():
    with emulated(order="simdgroup"):
        assert gdn.VERIFY.status() == "active" and gdn.REPLAY.status() == "active"


# ---------------------------------------------------------------- in the loop
def _qwen3_5(quantized: bool = False, **overrides):
    import mlx.nn as nn
    from checkpoints import build_target

    model, _ = build_target("qwen3_5", seed=1, **overrides)
    model.eval()  # as mlx_lm.load leaves it: inference, where kernels may run
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    return model


def _close_to_fresh_prefill(model, cache, committed):
    """The cache after rollback through the emulated kernels against mlx-lm
    feeding the committed tokens in one pass: another batching and another
    summation order (mlx-lm's ops, not the kernels), so float32 sums may differ
    in their last bits, carried through the layers. A wrong rollback (a step
    too many or too few) moves a state by a good part of its own size; the
    tolerance, 2^-12 of each tensor's largest entry, is far below that."""
    fresh = Target(model).make_cache()
    model(mx.array(committed)[None], cache=fresh)
    for i, (c, f) in enumerate(zip(cache, fresh)):
        pairs = zip(c.cache, f.cache) if isinstance(c, ArraysCache) else zip(c.keys_and_values(), f.keys_and_values())
        for a, b in pairs:
            scale = max(float(mx.max(mx.abs(b))), 1e-30)
            assert a.shape == b.shape and float(mx.max(mx.abs(a - b))) <= 2**-12 * scale, f"layer {i}"


def _oracle_run(model, prompt, block_size, corrupt_at, cycles=2):
    from test_loop import OracleProposer

    target = Target(model)
    continuation = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=(cycles + 1) * block_size + 2)]
    oracle = OracleProposer(len(prompt), continuation, corrupt_at, target.vocab_size)
    decoder = SpeculativeDecoder(target, oracle, [0], block_size, prefill_step_size=4)
    out = [decoder.prefill(mx.array(prompt))]
    for _ in range(cycles):
        cycle = decoder.cycle()
        assert cycle.accepted == (block_size - 1 if corrupt_at is None else corrupt_at)
        out += cycle.tokens
    return out, continuation, decoder, _close_to_fresh_prefill


class Counting:
    """An emulated backend that counts launches per kernel."""

    def __init__(self, order="shuffle"):
        self.launches: dict[str, int] = {}
        self.backend = kernels.Backend(f"emulated-counting-{order}", lambda: True, self.make, {"order": order})

    def make(self, **kw):
        inner = metal_kernel(**kw)

        def call(**args):
            self.launches[kw["name"]] = self.launches.get(kw["name"], 0) + 1
            return inner(**args)
        return call


@needs_gxx
@pytest.mark.parametrize("block_size", [5])
def test_rollback_at_every_acceptance_length_with_the_kernels(block_size):
    """Verify and rollback through the emulated kernels: the cache after each
    cycle is what a fresh prefill of the committed tokens gives, and the tokens
    are mlx-lm's."""
    model = _qwen3_5()
    prompt = [5, 17, 3, 99, 42, 7]
    counting = Counting()
    with kernels.use_backend(counting.backend):
        for corrupt_at in [*range(block_size - 1), None]:
            out, continuation, decoder, same_as_prefill = _oracle_run(model, prompt, block_size, corrupt_at)
            assert out == continuation[: len(out)]
            same_as_prefill(model, decoder.cache, prompt + out[:-1])
    assert counting.launches["gdn_verify"] > 0
    assert counting.launches["gdn_replay"] > 0  # every corrupted cycle rolled back through it


@needs_gxx
def test_recorded_data_path_records_and_replays():
    model = _qwen3_5()
    target = Target(model)
    tokens = mx.array([[3, 9, 27, 81, 243, 217, 139, 417]])
    plain_cache, kernel_cache = target.make_cache(), target.make_cache()
    plain = target.forward(tokens, plain_cache, [1], record=True)
    with emulated():
        fwd = target.forward(tokens, kernel_cache, [1], record=True)
        records = [r for r in fwd.records if r is not None]
        assert records and all(r.g is not None and r.beta is not None for r in records)
        target.rollback(kernel_cache, fwd, 3)
    assert all(r.g is None for r in plain.records if r is not None)  # no backend: the reference path
    # float32 sums in another order: agreement to ~1e-6 of the hidden states' size
    peak = float(mx.max(mx.abs(plain.hidden)))
    np.testing.assert_allclose(np.array(fwd.hidden), np.array(plain.hidden), rtol=0, atol=4e-6 * peak)
    target.rollback(plain_cache, plain, 3)
    linear = [(a, b) for a, b in zip(plain_cache, kernel_cache) if isinstance(a, ArraysCache)]
    assert mx.array_equal(linear[0][0][0], linear[0][1][0]).item()  # first layer's conv window: same slice
    for a, b in linear:  # later layers see the (float-rounding) differences of the earlier ones
        for j in range(2):
            peak = float(mx.max(mx.abs(a[j])))
            np.testing.assert_allclose(np.array(b[j]), np.array(a[j]), rtol=0, atol=4e-6 * peak)


@needs_gxx
def test_quantized_target_is_lossless_with_every_kernel_emulated():
    """4-bit qwen3_5 target: the verify pass's quantized matmuls, the GatedDeltaNet
    recurrence and its rollback all run as emulated Metal; greedy output is
    mlx-lm's, token for token, at every acceptance length tried."""
    model = _qwen3_5(quantized=True)
    prompt = [11, 200, 3, 47, 5]
    counting = Counting(order="simdgroup")
    with kernels.use_backend(counting.backend):
        for corrupt_at in (0, 2, None):
            out, continuation, decoder, same_as_prefill = _oracle_run(model, prompt, 4, corrupt_at)
            assert out == continuation[: len(out)]
    for name in ("qmm_verify", "gdn_verify", "gdn_replay"):
        assert counting.launches.get(name, 0) > 0, name
    # outside the pass the model is back as it was
    import mlx.nn as nn
    assert isinstance(model.layers[0].linear_attn.in_proj_qkv, nn.QuantizedLinear)
    assert not vars(model.layers[0].linear_attn).get("in_proj_qkv")


@needs_gxx
def test_generation_with_a_draft_is_mlx_lm_greedy(target_dirs, draft_dir):
    """The public API with the GatedDeltaNet kernels emulated in the loop."""
    from mlx_lm import load as mlx_lm_load
    from test_loop import assert_same_or_near_tie

    from dflash_mlx import generate, load_draft

    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    draft = load_draft(str(draft_dir("qwen3_5", block_size=8)))
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    want = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=16)]
    with emulated():
        got = generate(model, draft, tokenizer, prompt, max_tokens=16, block_size=8).tokens
        assert gdn.VERIFY.status() == "active" and gdn.REPLAY.status() == "active"
    eos = tokenizer.eos_token_id
    if eos in want:
        want = want[: want.index(eos)]
    assert_same_or_near_tie(model, ids, got, want)


def test_padded_batches_are_refused():
    model = _qwen3_5()
    layer = next(layer for layer in model.layers if getattr(layer, "is_linear", False))
    cache = ArraysCache(2)
    x = mx.zeros((1, 3, Target(model).hidden_size))
    with pytest.raises(NotImplementedError, match="padded batches"):
        gd_adapter.recording_attention(layer.linear_attn, x, mx.ones((1, 3), dtype=mx.bool_), cache)


# ---------------------------------------------------------------- on a Mac
@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="on-device parity needs Metal")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 16, 16, 32, 128, 128), (2, 16, 16, 48, 128, 128), (3, 4, 2, 4, 64, 32)],
                         ids=["qwen3.5-9B", "qwen3.5-27B B2", "small"])
def test_on_device_parity(dtype, shape):
    """The compiled Metal kernels against mlx-lm (``pytest -m metal``): verify vs
    gated_delta_ops; replay at every length vs the verify kernel, bit for bit."""
    B, T, Hk, Hv, Dk, Dv = shape
    q, k, v, g, beta, state = gdn.make_inputs(np.random.default_rng(0), B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv,
                                              dtype=dtype)
    got = gdn.VERIFY.launch(q, k, v, g, beta, state)
    assert gdn.VERIFY.compare(got, gdn.VERIFY.reference(q, k, v, g, beta, state), (q, k, v, g, beta, state),
                                   {}) is None
    for keep in range(T + 1):
        (replayed,) = gdn.REPLAY.launch(k, v, g, beta, state, mx.full((B,), keep, dtype=mx.int32))
        want = state if keep == 0 else gdn.VERIFY.launch(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep],
                                                          beta[:, :keep], state)[1]
        assert mx.array_equal(replayed, want).item(), f"keep {keep}"


@needs_gxx
def test_a_batch_rolls_each_row_back_in_one_replay_launch():
    """Rows of a batch keeping different step counts go back in one gdn_replay
    launch per layer (each row its own count), to exactly the states each row
    gets rolled back alone."""
    model = _qwen3_5()
    target = Target(model)
    tokens = mx.array([[3, 9, 27, 81, 243, 217], [5, 17, 3, 99, 42, 7]])
    keeps = [2, 5]
    counting = Counting()
    rows = lambda: [c if isinstance(c, ArraysCache) else RowKVCache(lengths=[0, 0]) for c in target.make_cache()]
    with kernels.use_backend(counting.backend):
        warm = rows()  # the kernels' first use runs their self-checks
        target.rollback_rows(warm, target.forward(tokens, warm, [1], record=True), keeps)
        cache = rows()
        fwd = target.forward(tokens, cache, [1], record=True)
        replays = counting.launches.get("gdn_replay", 0)
        target.rollback_rows(cache, fwd, keeps)
        layers = sum(r is not None and hasattr(r, "g") for r in fwd.records)
        assert counting.launches["gdn_replay"] - replays == layers  # one launch per layer for both rows
        for r, keep in enumerate(keeps):
            for c, rec in zip(cache, fwd.records):
                if isinstance(c, ArraysCache):
                    alone = ArraysCache(2)
                    gd_adapter.restore(alone, rec.row(r), keep)
                    assert mx.array_equal(c[0][r : r + 1], alone[0]).item()
                    assert mx.array_equal(c[1][r : r + 1], alone[1]).item()
