"""The CPU emulation harness itself (dflash_mlx.emulate): small kernels whose
answers are known, for barriers, SIMD-group functions, attributes, types,
atomics and the errors it must catch. Compiled objects are cached by source
hash, so reruns only execute."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.emulate import EmulationError, metal_kernel, rewrite_threadgroup, write_signature

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the harness needs g++")


def run(source, inputs, names, out_shape, out_dtype=mx.int32, grid=(32, 1, 1), tg=(32, 1, 1), **kw):
    kernel = metal_kernel("t", names, ["out"], source, header=kw.pop("header", ""),
                          atomic_outputs=kw.pop("atomic_outputs", False))
    return kernel(inputs=inputs, output_shapes=[out_shape], output_dtypes=[out_dtype],
                  grid=grid, threadgroup=tg, **kw)[0]


DUMMY = [mx.zeros((8,), dtype=mx.int32)]


# ---------------------------------------------------------------- barriers
ROTATE = """
threadgroup int shared[256];
uint i = thread_position_in_threadgroup.x;
uint n = threads_per_threadgroup.x;
shared[i] = int(thread_position_in_grid.x);
{barrier}
out[thread_position_in_grid.x] = shared[(i + 1) % n];
"""


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle"])
def test_barrier_makes_every_write_visible(order):
    src = ROTATE.format(barrier="threadgroup_barrier(mem_flags::mem_threadgroup);")
    got = run(src, DUMMY, ["dummy"], (512,), grid=(512, 1, 1), tg=(256, 1, 1), order=order)
    i = np.arange(512)
    want = (i // 256) * 256 + (i % 256 + 1) % 256
    np.testing.assert_array_equal(np.array(got), want)


@pytest.mark.parametrize("order", ["forward", "shuffle"])
def test_missing_barrier_reads_unwritten_memory(order):
    """Threadgroup memory starts poisoned, so a read racing its write shows."""
    src = ROTATE.format(barrier="")
    got = np.array(run(src, DUMMY, ["dummy"], (256,), grid=(256, 1, 1), tg=(256, 1, 1), order=order))
    assert (got == -1).any()  # 0xFFFFFFFF: memory no thread had written yet


def test_barrier_some_threads_skipped_is_an_error():
    src = """
    if (thread_position_in_threadgroup.x == 3) return;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = 1;
    """
    with pytest.raises(EmulationError, match="threadgroup_barrier reached by 31 of 32"):
        run(src, DUMMY, ["dummy"], (32,))


def test_divergent_barriers_deadlock_is_reported():
    src = """
    if (thread_index_in_simdgroup < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); }
    else { out[0] = simd_sum(1); threadgroup_barrier(mem_flags::mem_threadgroup); }
    out[thread_position_in_grid.x] = 1;
    """
    # the 16 lanes at simd_sum resolve as their own active set; then all meet at
    # the barrier (two different barrier calls count as one, as on the GPU)
    got = np.array(run(src, DUMMY, ["dummy"], (32,)))
    assert (got == 1).all()
    src = """
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (thread_position_in_threadgroup.x == 0) { while (true) { threadgroup_barrier(mem_flags::mem_threadgroup); } }
    out[thread_position_in_grid.x] = 1;
    """
    with pytest.raises(EmulationError, match="threadgroup_barrier reached by 1 of 64"):
        run(src, DUMMY, ["dummy"], (64,), grid=(64, 1, 1), tg=(64, 1, 1))


# ---------------------------------------------------------------- SIMD-group functions
def test_simd_sum_over_full_and_partial_simdgroups():
    """A 40-thread group has a 32-lane and an 8-lane SIMD-group."""
    src = "out[thread_position_in_grid.x] = simd_sum(int(thread_position_in_grid.x));"
    got = np.array(run(src, DUMMY, ["dummy"], (80,), grid=(80, 1, 1), tg=(40, 1, 1)))
    i = np.arange(80)
    want = np.array([np.arange(s, min(s + 32, (g + 1) * 40)).sum()
                     for g, s in zip(i // 40, (i // 40) * 40 + (i % 40) // 32 * 32)])
    np.testing.assert_array_equal(got, want)


def test_simd_reductions_and_prefix_sums():
    src = """
    uint l = thread_index_in_simdgroup;
    float v = x[thread_position_in_grid.x];
    uint base = thread_position_in_grid.x * 6;
    out[base + 0] = simd_sum(v);
    out[base + 1] = simd_max(v);
    out[base + 2] = simd_min(v);
    out[base + 3] = simd_prefix_exclusive_sum(v);
    out[base + 4] = simd_prefix_inclusive_sum(v);
    out[base + 5] = float(simd_broadcast_first(l + 7));
    """
    x = np.random.default_rng(0).integers(-50, 50, 64).astype(np.float32)
    got = np.array(run(src, [mx.array(x)], ["x"], (64, 6), mx.float32, grid=(64, 1, 1), tg=(64, 1, 1)))
    for g in range(2):
        xs = x[g * 32:(g + 1) * 32]
        rows = got[g * 32:(g + 1) * 32]
        np.testing.assert_array_equal(rows[:, 0], xs.sum())
        np.testing.assert_array_equal(rows[:, 1], xs.max())
        np.testing.assert_array_equal(rows[:, 2], xs.min())
        np.testing.assert_array_equal(rows[:, 3], np.concatenate([[0], np.cumsum(xs)[:-1]]))
        np.testing.assert_array_equal(rows[:, 4], np.cumsum(xs))
        np.testing.assert_array_equal(rows[:, 5], 7)


def test_simd_shuffles_and_broadcast():
    src = """
    uint l = thread_index_in_simdgroup;
    int v = int(l) * 10;
    uint base = thread_position_in_grid.x * 5;
    out[base + 0] = simd_shuffle(v, (l + 3) % 32);
    out[base + 1] = simd_shuffle_down(v, 4);
    out[base + 2] = simd_shuffle_up(v, 2);
    out[base + 3] = simd_shuffle_xor(v, 5);
    out[base + 4] = simd_broadcast(v, 9);
    """
    got = np.array(run(src, DUMMY, ["dummy"], (32, 5)))
    lane = np.arange(32)
    np.testing.assert_array_equal(got[:, 0], (lane + 3) % 32 * 10)
    # MSL: the upper `delta` lanes of shuffle_down (lower of shuffle_up) keep their value
    np.testing.assert_array_equal(got[:, 1], np.where(lane + 4 < 32, lane + 4, lane) * 10)
    np.testing.assert_array_equal(got[:, 2], np.where(lane >= 2, lane - 2, lane) * 10)
    np.testing.assert_array_equal(got[:, 3], (lane ^ 5) * 10)
    np.testing.assert_array_equal(got[:, 4], 90)


def test_simd_shuffle_tree_reduction():
    src = """
    float v = x[thread_position_in_grid.x];
    for (ushort d = 16; d > 0; d /= 2) v += simd_shuffle_xor(v, d);
    out[thread_position_in_grid.x] = v;
    """
    x = np.random.default_rng(1).normal(size=32).astype(np.float32)
    got = np.array(run(src, [mx.array(x)], ["x"], (32,), mx.float32))
    np.testing.assert_allclose(got, x.sum(), rtol=1e-6)


def test_inactive_lanes_are_left_out_of_collectives():
    src = """
    uint l = thread_index_in_simdgroup;
    if (l >= 20) return;
    out[l] = simd_sum(1);
    """
    got = np.array(run(src, DUMMY, ["dummy"], (32,)))
    np.testing.assert_array_equal(got[:20], 20)
    assert (got[20:] == -1).all()  # never written: still the poison


# ---------------------------------------------------------------- attributes and signature
def test_attributes_on_a_ragged_2d_grid():
    """Grid 37 x 5 in 16 x 4 groups: the edge groups are partial, as with dispatchThreads."""
    src = """
    uint3 p = thread_position_in_grid;
    uint idx = (p.y * 37 + p.x) * 6;
    out[idx + 0] = threadgroup_position_in_grid.x;
    out[idx + 1] = threadgroup_position_in_grid.y;
    out[idx + 2] = thread_position_in_threadgroup.x;
    out[idx + 3] = threads_per_threadgroup.x;
    out[idx + 4] = threads_per_grid.x;
    out[idx + 5] = threadgroups_per_grid.y;
    """
    got = np.array(run(src, DUMMY, ["dummy"], (5, 37, 6), mx.uint32, grid=(37, 5, 1), tg=(16, 4, 1)))
    y, x = np.meshgrid(np.arange(5), np.arange(37), indexing="ij")
    np.testing.assert_array_equal(got[..., 0], x // 16)
    np.testing.assert_array_equal(got[..., 1], y // 4)
    np.testing.assert_array_equal(got[..., 2], x % 16)
    np.testing.assert_array_equal(got[..., 3], np.where(x // 16 == 2, 5, 16))
    np.testing.assert_array_equal(got[..., 4], 37)
    np.testing.assert_array_equal(got[..., 5], 2)


def test_signature_follows_mlx_write_signature():
    """Small inputs go in `constant`, scalars by reference, shape/strides/ndim
    only when the body names them, attributes in MLX's order."""
    src = "x_shape[0]; y_ndim; thread_position_in_grid; simdgroup_index_in_threadgroup;"
    text, params, attrs, _ = write_signature(
        "k", src, ["x", "y", "s"], [mx.zeros((10,)), mx.zeros((2, 2), mx.float16), mx.array(3)],
        ["o"], [mx.bfloat16], [("T", mx.float32), ("N", 4), ("F", True)], atomic_outputs=False)
    assert text.startswith("template <typename T, int N, bool F>\n[[kernel]] void k(")
    assert [p.decl for p in params] == [
        "const device float* x", "const constant int* x_shape",
        "const constant float16_t* y", "const constant int& y_ndim",
        "const constant int32_t& s", "device bfloat16_t* o"]
    assert attrs == ["simdgroup_index_in_threadgroup", "thread_position_in_grid"]


def test_shape_strides_ndim_and_scalar_inputs():
    src = """
    out[0] = x_shape[0]; out[1] = x_shape[1]; out[2] = int(x_strides[0]); out[3] = x_ndim;
    out[4] = s; out[5] = int(x[x_strides[0] * 2 + 1]);
    """
    x = mx.arange(12, dtype=mx.int32).reshape(3, 4)
    got = np.array(run(src, [x, mx.array(42, dtype=mx.int32)], ["x", "s"], (6,), grid=(1, 1, 1), tg=(1, 1, 1)))
    np.testing.assert_array_equal(got, [3, 4, 4, 2, 42, 9])


def test_template_arguments_and_threadgroup_rewrite():
    assert rewrite_threadgroup("threadgroup T buf[N * 2];") == "auto& buf = ::emu::tg_alloc<T[N*2]>(1);"
    assert rewrite_threadgroup("threadgroup float* p = q;") == "threadgroup float* p = q;"
    src = """
    threadgroup T buf[N];
    uint i = thread_position_in_threadgroup.x;
    buf[i] = T(i) * T(2);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = FLAG ? float(buf[N - 1 - i]) : -1.0f;
    """
    got = run(src, DUMMY, ["dummy"], (16,), mx.float32, grid=(16, 1, 1), tg=(16, 1, 1),
              template=[("T", mx.float16), ("N", 16), ("FLAG", True)])
    np.testing.assert_array_equal(np.array(got), (15 - np.arange(16)) * 2)


# ---------------------------------------------------------------- types and atomics
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_and_bfloat_round_like_mlx(dtype):
    """float -> half/bfloat conversion, same-type arithmetic and reading back."""
    src = """
    uint i = thread_position_in_grid.x;
    T a = T(x[i]);
    out[i] = a * T(3);
    """
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(size=200) * 10.0 ** rng.integers(-9, 6, 200),
                        [0.0, -0.0, 1e-8, 65504.0, 7e4, np.inf, -np.inf]]).astype(np.float32)
    got = run(src, [mx.array(x)], ["x"], (x.size,), dtype, grid=(x.size, 1, 1), tg=(64, 1, 1),
              template=[("T", dtype)])
    want = mx.array(x).astype(dtype) * mx.array(3, dtype=dtype)
    assert mx.array_equal(got, want, equal_nan=True)


def test_atomics_across_threadgroups():
    src = """
    atomic_fetch_add_explicit(&out[0], 1, memory_order_relaxed);
    atomic_fetch_min_explicit(&out[1], int(thread_position_in_grid.x) - 500, memory_order_relaxed);
    atomic_fetch_max_explicit(&out[2], int(thread_position_in_grid.x), memory_order_relaxed);
    """
    got = np.array(run(src, DUMMY, ["dummy"], (3,), grid=(1000, 1, 1), tg=(128, 1, 1),
                       atomic_outputs=True, init_value=0, workers=2))
    np.testing.assert_array_equal(got, [1000, -500, 999])


# ---------------------------------------------------------------- errors the harness catches
def test_writes_out_of_bounds_are_caught():
    src = "out[thread_position_in_grid.x + 1] = 1;"
    with pytest.raises(EmulationError, match="wrote outside output 'out'"):
        run(src, DUMMY, ["dummy"], (32,))


def test_outputs_are_poisoned_before_the_run():
    src = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;"
    got = np.array(run(src, DUMMY, ["dummy"], (32,), mx.float32))
    assert np.isnan(got[1::2]).all() and (got[::2] == 1).all()


def test_too_much_threadgroup_memory_is_an_error():
    src = "threadgroup float big[9000]; big[0] = 1; out[0] = big[0];"
    with pytest.raises(EmulationError, match="exceeds 32 KiB"):
        run(src, DUMMY, ["dummy"], (1,), mx.float32, grid=(1, 1, 1), tg=(1, 1, 1))


def test_compile_errors_name_the_kernel_line():
    with pytest.raises(EmulationError, match=r"t\.metal:2"):
        run("uint i = 0;\nout[i] = undefined_name;", DUMMY, ["dummy"], (1,))
