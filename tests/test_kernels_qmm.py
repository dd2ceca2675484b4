"""The block-verify quantized matmul (metal/qmm_verify.metal), proven without a Mac.

- The harness's simdgroup_matrix (8x8 load / store / multiply_accumulate) on
  small kernels whose answers are known, and the errors it must catch.
- The kernel's own source, emulated, against ``mx.quantized_matmul`` on fresh
  random inputs: M in {1, 3, 8, 16, 17, 32}; N not a multiple of the 64-column
  tile or of 8; K a multiple of the group size but not of 64 where the group
  allows; every bits x group size x dtype combination. The full cross product
  is ``-m slow``.
- Mutations of the source fail the comparison.
- The per-instance wrapper: swaps only the given instance's QuantizedLinear
  layers, only inside the verify pass, leaves the parameter tree and the
  mlx-lm/MLX classes alone, and falls back to ``mx.quantized_matmul`` for what
  the kernel does not cover.
- On-device parity (``-m metal``): only where Metal exists.

Tolerances. Against ``mx.quantized_matmul``: |kernel - reference| <= c x
sum_k |x[m, k]| |dequant(w)[n, k]|, with c = 4 units in the last place of the
activation dtype (2^-20 float32, 2^-8 float16, 2^-5 bfloat16), because the
reference may round dequantized weights and partial sums to that dtype (MLX's
CPU path: up to 1.6e-3 of that scale for float16, 1.1e-2 for bfloat16).
Against the exact product (float64, weights unpacked here from the bits): the
kernel is held to what float staging allows, half an ulp of the output dtype
of |y| plus K x 2^-23 of the scale sum.
"""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import kernels
from dflash_mlx.targets import verify_matmuls
from dflash_mlx.emulate import EmulationError, metal_kernel
from dflash_mlx.kernels.emulated import emulated_backend, run_kernel
from dflash_mlx.kernels import qmm

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
ROWS = [1, 3, 8, 16, 17, 32]
EXACT_ULP = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}  # half an ulp




def emulated(**kw):
    return kernels.use_backend(emulated_backend(**kw))


# ---------------------------------------------------------------- harness: simdgroup_matrix
def run(source, inputs, names, out_shape, out_dtype=mx.float32, grid=(32, 1, 1), tg=(32, 1, 1), **kw):
    kernel = metal_kernel("sgm", names, ["out"], source)
    return np.array(kernel(inputs=inputs, output_shapes=[out_shape], output_dtypes=[out_dtype],
                           grid=grid, threadgroup=tg, **kw)[0])


MMA = """
threadgroup float A[64];
threadgroup float B[64];
threadgroup float C[64];
uint l = thread_index_in_simdgroup;
for (uint i = l; i < 64; i += 32) { A[i] = a[i]; B[i] = b[i]; C[i] = c[i]; }
simdgroup_barrier(mem_flags::mem_threadgroup);
simdgroup_float8x8 ma, mb, mc, md;
simdgroup_load(ma, A);
simdgroup_load(mb, B, 8, ulong2(0, 0), {transpose});
simdgroup_load(mc, C);
simdgroup_multiply_accumulate(md, ma, mb, mc);
simdgroup_store(md, out);
"""


@needs_gxx
@pytest.mark.parametrize("transpose", [False, True])
def test_simdgroup_multiply_accumulate_known_answer(transpose):
    """Small integers: every product and sum is exact in float, so d = a b + c exactly."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(-4, 5, size=(8, 8)).astype(np.float32) for _ in range(3))
    got = run(MMA.replace("{transpose}", "true" if transpose else "false"),
              [mx.array(a), mx.array(b), mx.array(c)], ["a", "b", "c"], (8, 8))
    np.testing.assert_array_equal(got, a @ (b.T if transpose else b) + c)


@needs_gxx
def test_simdgroup_load_store_stride_origin_and_transpose():
    """A tile inside a 16 x 24 matrix: elements_per_row is the row stride,
    matrix_origin is (column, row) in memory, transpose_matrix transposes."""
    src = """
    simdgroup_float8x8 t, tt;
    simdgroup_load(t, m, 24, ulong2(5, 3));
    simdgroup_load(tt, m, 24, ulong2(5, 3), true);
    simdgroup_store(t, out, 16);
    simdgroup_store(tt, out + 8, 16);
    simdgroup_store(t, out + 128, 16, ulong2(0, 0), true);
    simdgroup_store(make_filled_simdgroup_matrix<float, 8, 8>(7.0f), out + 136, 16);
    """
    m = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    got = run(src, [mx.array(m)], ["m"], (16, 16))
    tile = m[3:11, 5:13]
    np.testing.assert_array_equal(got[:8, :8], tile)
    np.testing.assert_array_equal(got[:8, 8:], tile.T)
    np.testing.assert_array_equal(got[8:, :8], tile.T)  # stored transposed
    np.testing.assert_array_equal(got[8:, 8:], np.full((8, 8), 7.0))


@needs_gxx
def test_simdgroup_diagonal_constructor_multiply_and_half_types():
    src = """
    simdgroup_half8x8 x, d = simdgroup_half8x8(half(2.0f)), r;
    simdgroup_load(x, a);
    simdgroup_multiply(r, x, d);   // x * 2I
    simdgroup_store(r, out);
    """
    a = (np.arange(64, dtype=np.float32).reshape(8, 8) / 8).astype(np.float16)
    got = run(src, [mx.array(a)], ["a"], (8, 8), mx.float16)
    np.testing.assert_array_equal(got, a * 2)


@needs_gxx
def test_bfloat_matrices_round_once_to_bfloat():
    src = """
    simdgroup_bfloat8x8 x, y, z;
    simdgroup_load(x, a);
    simdgroup_load(y, b);
    z = make_filled_simdgroup_matrix<bfloat, 8, 8>(bfloat(0.0f));
    simdgroup_multiply_accumulate(z, x, y, z);
    simdgroup_store(z, out);
    """
    rng = np.random.default_rng(1)
    a = mx.array(rng.normal(size=(8, 8)).astype(np.float32)).astype(mx.bfloat16)
    b = mx.array(rng.normal(size=(8, 8)).astype(np.float32)).astype(mx.bfloat16)
    kernel = metal_kernel("sgm_bf", ["a", "b"], ["out"], src)
    got = kernel(inputs=[a, b], output_shapes=[(8, 8)], output_dtypes=[mx.bfloat16],
                 grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
    exact = np.array(a.astype(mx.float32)) @ np.array(b.astype(mx.float32))
    want = mx.array(exact.astype(np.float32)).astype(mx.bfloat16)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2.0**-7, atol=1e-6)


@needs_gxx
def test_an_accumulator_never_filled_is_nan():
    src = """
    simdgroup_float8x8 x, acc;
    simdgroup_load(x, a);
    simdgroup_multiply_accumulate(acc, x, x, acc);
    simdgroup_store(acc, out);
    """
    got = run(src, [mx.array(np.ones((8, 8), np.float32))], ["a"], (8, 8))
    assert np.isnan(got).all()


@needs_gxx
@pytest.mark.parametrize("case, source, tg, message", [
    ("divergent lanes", """
     simdgroup_float8x8 x;
     if (thread_index_in_simdgroup < 16) { simdgroup_load(x, a); simdgroup_store(x, out); }
     """, 32, "reached by 16 of the 32 lanes"),
    ("partial SIMD-group", """
     simdgroup_float8x8 x;
     simdgroup_load(x, a);
     simdgroup_store(x, out);
     """, 16, "reached by 16 of the 32 lanes"),
    ("lane-dependent pointer", """
     simdgroup_float8x8 x;
     simdgroup_load(x, a + (thread_index_in_simdgroup & 1));
     simdgroup_store(x, out);
     """, 32, "passed different arguments"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else "")
def test_simdgroup_matrix_misuse_is_an_error(case, source, tg, message):
    a = mx.array(np.ones((80,), np.float32))
    with pytest.raises(EmulationError, match=message):
        run(source, [a], ["a"], (8, 8), grid=(tg, 1, 1), tg=(tg, 1, 1))


@needs_gxx
def test_simdgroup_order_exposes_a_missing_barrier_between_simdgroups():
    """SIMD-group 1 stages a tile that SIMD-group 0 multiplies. With the barrier
    every order gets it right; without it, the 'simdgroup' order (one SIMD-group
    at a time) reads the poisoned, unwritten tile."""
    src = """
    threadgroup float T[64];
    uint l = thread_index_in_simdgroup;
    if (simdgroup_index_in_threadgroup == 1) { T[l] = a[l]; T[l + 32] = a[l + 32]; }
    BARRIER
    if (simdgroup_index_in_threadgroup == 0) {
      simdgroup_float8x8 x;
      simdgroup_load(x, T);
      simdgroup_store(x, out);
    }
    """
    a = np.arange(64, dtype=np.float32)
    with_barrier = src.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    for order in ("forward", "shuffle", "simdgroup"):
        got = run(with_barrier, [mx.array(a)], ["a"], (8, 8), grid=(64, 1, 1), tg=(64, 1, 1), order=order)
        np.testing.assert_array_equal(got.ravel(), a)
    got = run(src.replace("BARRIER", ""), [mx.array(a)], ["a"], (8, 8), grid=(64, 1, 1), tg=(64, 1, 1),
              order="simdgroup", seed=1)
    assert np.isnan(got).any()


# ---------------------------------------------------------------- the kernel vs the reference
def unpacked(w, scales, biases, bits, group_size) -> np.ndarray:
    """dequant(w) in float64, unpacked here from MLX's layout (lowest bits first)."""
    words = np.array(w).astype(np.uint64)
    per = 32 // bits
    q = np.stack([(words >> np.uint64(bits * j)) & np.uint64((1 << bits) - 1) for j in range(per)], -1)
    q = q.reshape(words.shape[0], -1).astype(np.float64)
    s = np.array(scales.astype(mx.float32), dtype=np.float64).repeat(group_size, axis=1)
    b = np.array(biases.astype(mx.float32), dtype=np.float64).repeat(group_size, axis=1)
    return s * q + b


def test_unpacking_here_matches_mx_dequantize():
    for bits in (4, 8):
        (_, w, s, b), p = qmm.make_inputs(np.random.default_rng(bits), 2, 40, 256, bits=bits, group_size=64)
        want = np.array(mx.dequantize(w, s, b, group_size=64, bits=bits))
        np.testing.assert_allclose(unpacked(w, s, b, bits, 64), want, rtol=1e-6, atol=1e-6)


def check(M, N, K, bits, group_size, dtype, seed=0):
    inputs, params = qmm.make_inputs(np.random.default_rng(seed), M, N, K, bits=bits,
                                     group_size=group_size, dtype=dtype)
    order = ("shuffle", "simdgroup", "reverse")[seed % 3]
    (got,), problem = run_kernel("qmm_verify", *inputs, order=order, **params)
    assert problem is None, problem
    # and held to float staging against the exact product
    x = np.array(inputs[0].astype(mx.float32), dtype=np.float64)
    deq = unpacked(*inputs[1:], bits, group_size)
    exact = x @ deq.T
    scale = np.abs(x) @ np.abs(deq).T
    err = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - exact)
    bound = EXACT_ULP[dtype] * np.abs(exact) * 1.001 + K * 2.0**-23 * scale + 1e-30
    if dtype == mx.float16:  # subnormal outputs: half an ulp of the smallest normal
        bound += 2.0**-25
    assert (err <= bound).all(), f"worst error / bound {np.max(err / bound):.3f}"


# (M, N, K) per combination: every M appears, N ragged against 64 and 8, K not a
# multiple of 64 where the group size allows
COMBOS = [(bits, gs, dt) for bits in (4, 8) for gs in (32, 64, 128) for dt in DTYPES]
SHAPES = [(1, 70, 96), (3, 129, 192), (8, 64, 128), (16, 100, 256), (17, 33, 384), (32, 72, 128)]


@needs_gxx
@pytest.mark.parametrize("bits, group_size, dtype", COMBOS, ids=[f"{b}bit-g{g}-{d}".replace("mlx.core.", "")
                                                                  for b, g, d in COMBOS])
def test_every_bits_group_dtype_matches_reference(bits, group_size, dtype):
    i = COMBOS.index((bits, group_size, dtype))
    M, N, K = SHAPES[i % len(SHAPES)]
    K = -(-K // group_size) * group_size
    check(M, N, K, bits, group_size, dtype, seed=i)


@needs_gxx
@pytest.mark.parametrize("M", ROWS)
def test_every_row_count_matches_reference(M):
    check(M, 200, 320, 4, 32, mx.bfloat16, seed=M)
    check(M, 72, 256, 8, 128, mx.float16, seed=M + 100)


@needs_gxx
@pytest.mark.slow
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("bits, group_size, dtype", COMBOS)
def test_full_cross_product(M, bits, group_size, dtype):
    check(M, 130, 3 * group_size, bits, group_size, dtype, seed=M)


@needs_gxx
def test_qwen_like_width():
    """One layer-sized case: K = 4096 in 128 steps, N over several threadgroups."""
    check(16, 300, 4096, 4, 64, mx.bfloat16, seed=7)


# ---------------------------------------------------------------- mutations
MUTATIONS = [
    ("(packed >> (BITS * j)) & QMASK", "(packed >> (BITS * (PACK - 1 - j))) & QMASK", "nibble order"),
    ("scale * static_cast<float>", "static_cast<float>", "scale dropped"),
    ("& QMASK) + bias", "& QMASK)", "bias dropped"),
    ("const int group = k0 / GROUP_SIZE;", "const int group = k0 / 32;", "group index"),
    ("BK, ulong2(0, 0), true);\n    simdgroup_load(b1", "BK, ulong2(0, 0), false);\n    simdgroup_load(b1",
     "weight tile not transposed"),
    ("x[size_t(r) * K + k0 + (i % BK)]", "x[size_t(r) * K + (i % BK)]", "x tile offset"),
    ("  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  for (int kk", "\n  for (int kk",
     "missing barrier before the multiply"),
    ("if (r < M && n < N)", "if (r < M && n <= N)", "columns past N written"),
    ("  threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n", "}\n", "missing barrier after the multiply"),
    ("acc[m][1] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);", "", "accumulator not cleared"),
]


@needs_gxx
@pytest.mark.parametrize("text, replacement, what", MUTATIONS, ids=[m[2] for m in MUTATIONS])
def test_a_mutated_kernel_fails_the_comparison(text, replacement, what):
    source = qmm.KERNEL.source
    assert source.count(text) == 1, f"mutation target not found once: {text}"
    inputs, params = qmm.make_inputs(np.random.default_rng(3), 17, 100, 256, bits=4, group_size=64,
                                     dtype=mx.float32)
    _, problem = run_kernel("qmm_verify", *inputs, order="simdgroup", **params)
    assert problem is None
    try:  # SIMD-groups one at a time: a barrier missing between them shows
        _, problem = run_kernel("qmm_verify", *inputs, source=source.replace(text, replacement),
                                order="simdgroup", **params)
    except EmulationError as e:
        problem = str(e)
    assert problem is not None, f"mutation '{what}' went unnoticed"


# ---------------------------------------------------------------- dispatch
def test_uncovered_inputs_go_to_the_reference_with_a_reason():
    inputs, params = qmm.make_inputs(np.random.default_rng(0), 4, 16, 128, bits=4, group_size=64)
    x, w, s, b = inputs
    reason = qmm.KERNEL.unsupported
    assert reason(*inputs, **params) is None
    assert reason(mx.zeros((33, 128)), w, s, b, **params) == "33 rows (kernel: 1..32)"
    w3, s3, b3 = mx.quantize(mx.zeros((16, 128)), group_size=64, bits=3)
    assert reason(x, w3, s3, b3, group_size=64, bits=3) == "3-bit (kernel: 4 or 8)"
    assert reason(x, w, s, None, **params) == "no biases (kernel: affine quantization)"
    assert reason(x.astype(mx.int32), w, s, b, **params).startswith("dtype")
    assert reason(x.astype(mx.bfloat16), w, s, b, **params).startswith("x mlx.core.bfloat16 with scales")


@needs_gxx
def test_self_check_passes_and_the_kernel_runs_where_covered():
    inputs, params = qmm.make_inputs(np.random.default_rng(5), 16, 80, 128, bits=8, group_size=32,
                                     dtype=mx.bfloat16)
    with emulated():
        assert qmm.KERNEL.status() == "active"
        assert qmm.KERNEL.active(*inputs, **params)
        (got,) = qmm.KERNEL(*inputs, **params)
    assert qmm.KERNEL.compare((got,), qmm.KERNEL.reference(*inputs, **params), inputs, params) is None


# ---------------------------------------------------------------- the per-instance wrapper
class Block(nn.Module):
    def __init__(self, dims=128, bias=True):
        super().__init__()
        self.up = nn.Linear(dims, 96, bias=bias)
        self.down = nn.Linear(96, dims, bias=False)
        self.stack = [nn.Linear(dims, dims, bias=False)]

    def __call__(self, x):
        return self.stack[0](self.down(nn.gelu(self.up(x))))


def quantized_block(seed=0, **kw):
    mx.random.seed(seed)
    block = Block(**kw)
    nn.quantize(block, group_size=32, bits=4)
    return block


def test_no_swap_without_a_kernel_backend():
    block = quantized_block()
    with verify_matmuls.verification_matmuls(block) as swapped:
        assert swapped == 0
        assert isinstance(block.up, nn.QuantizedLinear)


@needs_gxx
def test_swap_is_per_instance_and_only_inside_the_pass():
    block, other = quantized_block(0), quantized_block(1)
    x = mx.array(np.random.default_rng(0).normal(size=(2, 8, 128)).astype(np.float32))
    want = block(x)
    params_before = tree_flatten(block.parameters())
    call_before = nn.QuantizedLinear.__call__
    calls = {"n": 0}
    original_launch = qmm.KERNEL.launch

    def counting_launch(*a, **k):
        calls["n"] += 1
        return original_launch(*a, **k)

    with emulated():
        assert qmm.KERNEL.enabled()  # the self-check ran (and launched) here
        qmm.KERNEL.launch = counting_launch
        try:
            with verify_matmuls.verification_matmuls(block) as swapped:
                assert swapped == 2  # up and down; a layer held in a list keeps MLX's matmul
                assert isinstance(block.up, verify_matmuls.VerifyLinear) and isinstance(block.stack[0], nn.QuantizedLinear)
                assert isinstance(other.up, nn.QuantizedLinear)  # another instance: untouched
                assert nn.QuantizedLinear.__call__ is call_before  # no class patched
                # the parameter tree is the same arrays under the same names
                during = tree_flatten(block.parameters())
                assert [k for k, _ in during] == [k for k, _ in params_before]
                assert all(a is b for (_, a), (_, b) in zip(during, params_before))
                got = block(x)  # 16 rows: the kernel
                assert calls["n"] == 2
                big = block(mx.concatenate([x, x, x], axis=1))  # 48 rows: mx.quantized_matmul
                assert calls["n"] == 2
        finally:
            qmm.KERNEL.launch = original_launch
    assert isinstance(block.up, nn.QuantizedLinear) and "up" not in vars(block)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(big[:, :8]), np.array(want), rtol=1e-5, atol=1e-5)


@needs_gxx
def test_wrapper_falls_back_for_other_modes_and_restores_after_errors():
    block = quantized_block()
    mx.random.seed(3)
    fp4 = nn.QuantizedLinear(128, 64, bias=False, mode="mxfp4")
    block.fp4 = fp4
    x = mx.array(np.random.default_rng(1).normal(size=(4, 128)).astype(np.float32))
    with emulated():
        with verify_matmuls.verification_matmuls(block):
            assert verify_matmuls.quantized_matmul(x, fp4) is None  # not affine: MLX's own matmul
            assert isinstance(block.fp4, verify_matmuls.VerifyLinear)
            np.testing.assert_array_equal(np.array(block.fp4(x)), np.array(fp4(x)))
        with pytest.raises(RuntimeError):
            with verify_matmuls.verification_matmuls(block):
                raise RuntimeError("the pass failed")
    assert isinstance(block.up, nn.QuantizedLinear) and block.fp4 is fp4


# ---------------------------------------------------------------- on a Mac
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("bits, group_size, dtype", COMBOS)
@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="on-device parity needs Metal")
def test_on_device_parity(M, bits, group_size, dtype):
    """The compiled Metal kernel against mx.quantized_matmul on the GPU (``pytest -m metal``)."""
    inputs, params = qmm.make_inputs(np.random.default_rng(M), M, 4100, 4096, bits=bits,
                                     group_size=group_size, dtype=dtype)
    got = qmm.KERNEL.launch(*inputs, **params)
    want = qmm.KERNEL.reference(*inputs, **params)
    assert qmm.KERNEL.compare(got, want, inputs, params) is None
