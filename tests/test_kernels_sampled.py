"""The rejection-sampling verification kernel (metal/verify_sampled.metal),
proven without a Mac: its own source runs through the CPU emulation harness
and is compared with its pure-MLX reference (dflash_mlx.kernels.verify_sampled);
mutations of the source must be caught; the kernel's samples follow the target's
distribution; edge cases (p = q, no residual mass, drafts outside the target's
support, ids out of range, V = 1) behave; sampled_verify dispatches to it.

Tolerances. The result is one packed int per sequence (accepted << 24 | token),
compared exactly, for float32, float16 and bfloat16 log-probabilities alike
(every input is converted to float32 before exp, in kernel and reference). The
only float difference between the harness and MLX's CPU backend is exp: the
kernel's metal::precise::exp runs as glibc's expf in the harness, while mx.exp
on the CPU is an approximation up to ~60 ulp (~7e-6 relative) away. (On Metal,
mx.exp is metal::precise::exp: no difference at all.) Hence two comparisons:

- bit for bit, on any inputs, against the reference evaluated with the
  harness's own exp (a one-line kernel through the same harness);
- decision for decision, against the plain mx.exp reference, on non-degenerate
  inputs (make_inputs): every acceptance test at least 1e-4 relative from its
  boundary and the draw at least 8x the largest boundary shift from the nearest
  CDF boundary.
"""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from dflash_mlx import emulate, kernels
from dflash_mlx.loop import acceptance
from dflash_mlx.emulate import EmulationError
from dflash_mlx.kernels.emulated import emulated_backend, run_kernel
from dflash_mlx.kernels import verify_sampled as vs
from dflash_mlx.kernels.registry import mismatch
from dflash_mlx.loop.verify import sampled_verify

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")




# ---------------------------------------------------------------- helpers
_EXP_BODY = """
uint i = thread_position_in_grid.x;
if (i < uint(x_shape[0])) {
  y[i] = metal::precise::exp(x[i]);
}
"""
_exp_kernel = emulate.metal_kernel(name="harness_exp", input_names=["x"], output_names=["y"], source=_EXP_BODY)


def harness_exp(x: mx.array) -> mx.array:
    """exp exactly as the emulated kernel computes it."""
    flat = x.astype(mx.float32).reshape(-1)
    n = flat.size
    (y,) = _exp_kernel(inputs=[flat], grid=(-(-n // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                       output_shapes=[(n,)], output_dtypes=[mx.float32])
    return y.reshape(x.shape)


def emulate_kernel(*inputs, source=None):
    got, _ = run_kernel("verify_sampled", *inputs, source=source, compare=False)
    return got[0]


def exact_problem(inputs, source=None):
    """None if the emulated kernel equals the reference bit for bit (same exp)."""
    try:
        got = emulate_kernel(*inputs, source=source)
    except EmulationError as e:  # the harness itself objects (memory, deadlock)
        return str(e)
    return mismatch("packed", got, acceptance.sampled(*inputs, exp=harness_exp))


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        x = x - np.max(x, axis=-1, keepdims=True)
        return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def random_inputs(rng, B, b, V, dtype=mx.float32, draft_dtype=None, scale=2.0):
    """Warped-like log-probabilities, drafts drawn from q, MLX uniforms: any decisions."""
    z = rng.normal(size=(B, b, V)) * scale
    zq = z[:, : b - 1] + rng.normal(size=(B, b - 1, V)) * scale * 0.7
    target = mx.array(log_softmax(z)).astype(dtype)
    draft = mx.array(log_softmax(zq)).astype(draft_dtype or dtype)
    seed = int(rng.integers(1 << 30))
    drafted = mx.random.categorical(draft.astype(mx.float32), key=mx.random.key(seed)).astype(mx.int32)
    uniforms = mx.random.uniform(shape=(B, b + 1), key=mx.random.key(seed + 1))
    return target, draft, drafted, uniforms


def unpacked(packed):
    a, t = acceptance.unpack(packed)
    return np.array(a).tolist(), np.array(t).tolist()


# ---------------------------------------------------------------- kernel vs reference
SHAPES = {  # (B, b, V)
    "b=2 V=7": (2, 2, 7),
    "ragged V b=16": (1, 16, 1000),
    "B=3 ragged V b=4": (3, 4, 4097),
    "B=2 Qwen3 vocab b=4": (2, 4, 151936),
    "Qwen3.5 vocab b=16": (1, 16, 248320),
    "B=2 max block": (2, 64, 300),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_reference(shape):
    B, b, V = shape
    rng = np.random.default_rng(V + b)
    for accept in ([0] * B, [b - 1] * B, None):  # reject at once, accept all, random
        inputs, accepted = vs.make_inputs(rng, B, b, V, accept=accept)
        got = emulate_kernel(*inputs)
        assert mismatch("packed", got, acceptance.sampled(*inputs)) is None  # plain mx.exp
        assert mismatch("packed", got, acceptance.sampled(*inputs, exp=harness_exp)) is None
        assert unpacked(got)[0] == accepted
    assert exact_problem(random_inputs(rng, B, b, V)) is None


@pytest.mark.parametrize("dtypes", [(mx.float16, mx.float16), (mx.bfloat16, mx.bfloat16),
                                    (mx.float32, mx.float32), (mx.bfloat16, mx.float32)],
                         ids=["float16", "bfloat16", "float32", "bf16 target, f32 draft"])
@pytest.mark.parametrize("shape", [(2, 16, 151936), (3, 8, 3001)], ids=["V=151936", "ragged"])
def test_dtypes(dtypes, shape):
    B, b, V = shape
    dtype, draft_dtype = dtypes
    rng = np.random.default_rng(b)
    inputs, accepted = vs.make_inputs(rng, B, b, V, dtype=dtype, draft_dtype=draft_dtype)
    assert inputs[0].dtype == dtype and inputs[1].dtype == draft_dtype
    got = emulate_kernel(*inputs)
    assert mismatch("packed", got, acceptance.sampled(*inputs)) is None
    assert unpacked(got)[0] == accepted
    assert exact_problem(random_inputs(rng, B, b, V, dtype, draft_dtype)) is None


def test_random_decisions_agree_with_the_mx_exp_reference():
    """On unconstructed inputs the exp noise of the harness almost never moves a
    decision: measured 0 of 400 sequences here."""
    inputs = random_inputs(np.random.default_rng(11), 400, 4, 1000)
    got = np.array(emulate_kernel(*inputs))
    want = np.array(acceptance.sampled(*inputs))
    assert (got != want).mean() <= 0.01


# ---------------------------------------------------------------- the samples are the target's
def _stat_case(n=4000, V=8, b=3, seed=5):
    """n sequences of one fixed block (p rows, q rows, a token q proposes
    outside p's support), drafts drawn from q, MLX uniforms: one launch."""
    rng = np.random.default_rng(seed)
    lp = rng.normal(size=(b, V)) * 1.5
    lp[0, 3] = -np.inf
    lp = log_softmax(lp)
    lq = log_softmax(rng.normal(size=(b - 1, V)) * 1.5)
    target = mx.broadcast_to(mx.array(lp)[None], (n, b, V))
    draft = mx.broadcast_to(mx.array(lq)[None], (n, b - 1, V))
    drafted = mx.random.categorical(draft, key=mx.random.key(seed)).astype(mx.int32)
    uniforms = mx.random.uniform(shape=(n, b + 1), key=mx.random.key(seed + 1))
    return (target, draft, drafted, uniforms), np.exp(lp.astype(np.float64))


def _pvalues(packed, drafted, p):
    """x1 over all sequences ~ p_0; x2 over those that accepted d_1 ~ p_1."""
    a, token = (np.array(x) for x in acceptance.unpack(packed))
    d = np.array(drafted)
    x1 = np.where(a >= 1, d[:, 0], token)
    kept = a >= 1
    x2 = np.where(a[kept] >= 2, d[kept, 1], token[kept])
    out = []
    for x, row in ((x1, p[0]), (x2, p[1])):
        counts = np.bincount(x, minlength=row.size)
        assert counts[row == 0].sum() == 0, "a token outside the target's support"
        support = row > 0
        out.append(chisquare(counts[support], row[support] / row.sum() * counts.sum()).pvalue)
    return out


def test_kernel_samples_follow_the_target_and_a_wrong_rule_is_caught():
    """Lossless in one launch of 4000 sequences: the first emitted token is
    distributed as p_0, the second (given d_1 was accepted) as p_1. Resampling
    from p instead of the residual after a rejection is caught."""
    inputs, p = _stat_case()
    packed = emulate_kernel(*inputs)
    assert mismatch("packed", packed, acceptance.sampled(*inputs, exp=harness_exp)) is None
    assert min(_pvalues(packed, inputs[2], p)) > 1e-4  # false failure <= 2e-4
    source = vs.KERNEL.source
    wrong = source.replace("const bool use_r = has_q && r_total > 0;", "const bool use_r = false;")
    assert wrong != source
    assert _pvalues(emulate_kernel(*inputs, source=wrong), inputs[2], p)[0] < 1e-4


# ---------------------------------------------------------------- edge cases
def _block(rows_p, rows_q, drafted, uniforms, dtype=mx.float32):
    n = len(uniforms)
    t = mx.array(np.log(np.asarray(rows_p, dtype=np.float64)).astype(np.float32))
    q = mx.array(np.log(np.asarray(rows_q, dtype=np.float64)).astype(np.float32))
    t = mx.broadcast_to(t[None], (n, *t.shape)).astype(dtype)
    q = mx.broadcast_to(q[None], (n, *q.shape)).astype(dtype)
    d = mx.broadcast_to(mx.array(drafted, dtype=mx.int32)[None], (n, len(drafted)))
    return t, q, d, mx.array(np.asarray(uniforms, dtype=np.float32))


def _grid_uniforms(n, b, rng):
    """n sequences of b+1 uniforms, including 0 and the largest float below 1."""
    u = rng.uniform(size=(n, b + 1)).astype(np.float32)
    u[0], u[1] = 0.0, np.nextafter(np.float32(1), np.float32(0))
    return u


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_p_equal_q_accepts_everything_and_draws_the_bonus_from_the_last_p():
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25, 0.0, 0.25, 0.5]])
    inputs = _block(p, p[:2], [1, 3], _grid_uniforms(64, 3, rng))
    assert exact_problem(inputs) is None
    accepted, tokens = unpacked(emulate_kernel(*inputs))
    assert accepted == [2] * 64
    assert set(tokens) <= {0, 2, 3} and tokens[0] == 0 and tokens[1] == 3  # u = 0: first, u -> 1: last


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_zero_residual_mass_falls_back_to_p():
    """p = q on every row but the first draft is outside both supports: it is
    rejected, max(p - q, 0) has no mass, and the token comes from p_0."""
    rng = np.random.default_rng(1)
    p = np.array([[0.3, 0.0, 0.7, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    u = _grid_uniforms(64, 3, rng)
    inputs = _block(p, p[:2], [1, 0], u)
    assert exact_problem(inputs) is None
    accepted, tokens = unpacked(emulate_kernel(*inputs))
    assert accepted == [0] * 64
    # inverse CDF on p_0's fixed-point weights with the same 48-bit uniforms
    U = (np.floor(u[:, 2].astype(np.float64) * 2**24) * 2**24 + np.floor(u[:, 3].astype(np.float64) * 2**24))
    assert tokens == np.where(U / 2**48 < 0.3, 0, 2).tolist()


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_draft_outside_the_target_support_is_always_rejected():
    """q proposes token 2, which top-k removed from p (p = 0): rejected for every
    uniform, even u = 0; the residual never gives it, nor any p = 0 token."""
    rng = np.random.default_rng(2)
    p = np.array([[0.6, 0.4, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    q = np.array([[0.2, 0.1, 0.6, 0.1]])
    inputs = _block(p, q, [2], _grid_uniforms(200, 2, rng))
    assert exact_problem(inputs) is None
    accepted, tokens = unpacked(emulate_kernel(*inputs))
    assert accepted == [0] * 200
    assert set(tokens) == {0, 1}  # residual max(p - q, 0) = (0.4, 0.3, 0, 0)
    assert tokens[0] == 0 and tokens[1] == 1


def test_ids_out_of_range_are_rejected_and_never_read():
    rng = np.random.default_rng(3)
    inputs, _ = vs.make_inputs(rng, 4, 3, 50, accept=[2, 2, 2, 2])
    target, draft, _, uniforms = inputs
    for bad in (-1, 50, 1 << 30):
        drafted = mx.array([[bad, 0], [0, bad], [bad, bad], [0, 0]], dtype=mx.int32)
        assert exact_problem((target, draft, drafted, uniforms)) is None
        accepted = unpacked(emulate_kernel(target, draft, drafted, uniforms))[0]
        assert accepted[0] == 0 and accepted[2] == 0 and accepted[1] <= 1


def test_vocabulary_of_one_and_a_row_without_mass():
    one = _block([[1.0], [1.0]], [[1.0]], [0], _grid_uniforms(3, 2, np.random.default_rng(4)))
    assert exact_problem(one) is None
    assert unpacked(emulate_kernel(*one)) == ([1, 1, 1], [0, 0, 0])
    # all -inf (not a distribution): no mass anywhere gives token V - 1, as documented
    t = mx.full((1, 2, 6), -np.inf)
    dead = (t, t[:, :1], mx.array([[2]], dtype=mx.int32), mx.array([[0.5, 0.5, 0.5]]))
    assert exact_problem(dead) is None
    assert unpacked(emulate_kernel(*dead)) == ([0], [5])


# ---------------------------------------------------------------- the tests have teeth
def _mutation_case():
    """Random blocks (ragged V, several SIMD-groups, B = 8), one sequence whose
    residual is empty, and four with p = q = uniform (every lane of the final
    scan then carries equal weight, so a wrong prefix sum moves the token)."""
    rng = np.random.default_rng(7)
    B, b, V = 8, 6, 3001
    target, draft, drafted, uniforms = random_inputs(rng, B, b, V)
    # q = p, and the first draft is outside both supports
    empty = mx.concatenate([mx.full((1, b, 1), -np.inf), target[:1, :, 1:]], axis=2)
    empty = empty - mx.logsumexp(empty, axis=-1, keepdims=True)
    flat = mx.full((4, b, V), -np.log(V))
    target = mx.concatenate([target, empty, flat], axis=0)
    draft = mx.concatenate([draft, empty[:, :-1], flat[:, :-1]], axis=0)
    drafted = mx.concatenate([drafted, mx.zeros((1, b - 1), dtype=mx.int32),
                              mx.array(rng.integers(0, V, size=(4, b - 1)), dtype=mx.int32)], axis=0)
    uniforms = mx.concatenate([uniforms, mx.array(rng.uniform(size=(5, b + 1)), dtype=mx.float32)], axis=0)
    return target, draft, drafted, uniforms


MUTATIONS = [  # text, replacement, what the mutation breaks
    ("ok = uniforms[seq * n_u + i] * q < p;", "ok = uniforms[seq * n_u + i] * p < q;", "acceptance ratio"),
    ("ok = uniforms[seq * n_u + i] * q < p;", "ok = uniforms[seq * n_u + i + 1] * q < p;", "acceptance uniform"),
    ("(size_t(seq) * n_draft + i) * vocab", "(size_t(seq) * block + i) * vocab", "draft row of a drafted token"),
    ("threadgroup_barrier(mem_flags::mem_threadgroup);\nuint a = 0;", "uint a = 0;", "barrier after the drafts"),
    ("const auto trow = target_logprobs + (size_t(seq) * block + a) * vocab;",
     "const auto trow = target_logprobs + (size_t(seq) * block + n_draft) * vocab;", "row of the draw"),
    ("#define DFL_R(pj, qj) ((pj) > (qj) ? (pj) - (qj) : ulong(0))",
     "#define DFL_R(pj, qj) ((pj) > (qj) ? (pj) - (qj) : (qj) - (pj))", "residual is max(p - q, 0)"),
    ("const bool use_r = has_q && r_total > 0;", "const bool use_r = has_q;", "fallback to p without residual"),
    ("const bool use_r = has_q && r_total > 0;", "const bool use_r = false;", "residual after a rejection"),
    ("const ulong u = (u_hi << 40) | (u_lo << 16);", "const ulong u = (u_lo << 40) | (u_hi << 16);",
     "order of the drawing uniforms"),
    ("+ (hl >> 32) + (lh >> 32) +", "+ (lh >> 32) +", "middle limb of the 64-bit product"),
    ("for (uint off = 16; off > 0; off >>= 1) {\n  p_sum", "for (uint off = 8; off > 0; off >>= 1) {\n  p_sum",
     "SIMD-group sum of p"),
    ("    break;\n  }\n  goal -= s;\n}\nconst uint seg_lo", "    break;\n  }\n}\nconst uint seg_lo",
     "goal within the segment"),
    ("  const ulong s = dfl_sub_sum[h];\n  if (s > goal) {\n    break;\n  }\n  goal -= s;",
     "  const ulong s = dfl_sub_sum[h];\n  if (s > goal) {\n    break;\n  }", "goal within the sub-segment"),
    ("if (lane >= off) {", "if (lane > off) {", "prefix sum"),
    ("token = simd_min(incl > goal ? j : 0xffffffffu);", "token = simd_min(incl - w > goal ? j : 0xffffffffu);",
     "inverse CDF picks the first prefix above the goal"),
    ("packed[seq] = int((a << 24) | token);", "packed[seq] = int((a << 23) | token);", "packing"),
]


@pytest.mark.parametrize("text, replacement, what", MUTATIONS, ids=[m[2] for m in MUTATIONS])
def test_a_mutated_kernel_fails_the_comparison(text, replacement, what):
    source = vs.KERNEL.source
    assert source.count(text) == 1, f"mutation target not found once: {text}"
    inputs = _mutation_case()
    assert exact_problem(inputs) is None  # the original passes on this very input
    assert exact_problem(inputs, source=source.replace(text, replacement)) is not None, \
        f"mutation '{what}' went unnoticed"


# ---------------------------------------------------------------- dispatch
def test_sampled_verify_uses_the_kernel_where_active_and_the_reference_elsewhere():
    inputs, _ = vs.make_inputs(np.random.default_rng(9), 3, 8, 2000)
    target, draft, drafted, _ = inputs
    key = mx.random.key(42)
    assert vs.KERNEL.reference_reason(*inputs) == "no metal backend"
    want = sampled_verify(target, draft, drafted, key)
    launches = []

    def counting(**kw):
        inner = emulate.metal_kernel(**kw)

        def call(**args):
            launches.append(kw["name"])
            return inner(**args)
        return call

    with kernels.use_backend(kernels.Backend("emulated-counting", lambda: True, counting)):
        assert vs.KERNEL.status() == "active"  # the self-check passed
        got = sampled_verify(target, draft, drafted, key)
        assert vs.KERNEL.reference_reason(target, draft[:, :3], drafted, inputs[3]).startswith("draft_logprobs")
    assert launches.count("verify_sampled") == 2  # self-check, then the call
    assert all(mx.array_equal(g, w) for g, w in zip(got, want))
    assert got[0].dtype == mx.int32 and got[1].dtype == mx.int32


def test_reference_switch_and_unsupported_shapes():
    inputs, _ = vs.make_inputs(np.random.default_rng(10), 1, 3, 40)
    with kernels.use_policy(kernels.KernelPolicy(emulated_backend(), frozenset({"verify_sampled"}))):
        assert vs.KERNEL.reference_reason(*inputs) == f"forced by {kernels.REFERENCE_ENV}"
    with kernels.use_backend(emulated_backend()):
        assert vs.KERNEL.active(*inputs)
        t = mx.zeros((1, 65, 10))
        assert vs.KERNEL.reference_reason(t, t[:, :64], mx.zeros((1, 64), mx.int32), mx.zeros((1, 66))) \
            == "block of 65 (kernel: 2..64)"
        assert "uniforms" in vs.KERNEL.reference_reason(*inputs[:3], inputs[3][:, :3])


def test_sampling_loop_with_the_emulated_kernel(target_dirs, draft_dir):
    """generate at temperature 1 with verify_sampled active (the other kernels
    forced to their references) gives the tokens of the reference path: same
    seed, same uniforms, same decisions."""
    from mlx_lm import load as mlx_lm_load

    from dflash_mlx import generate, load_draft

    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    draft = load_draft(str(draft_dir("qwen3", block_size=8)))
    run = lambda: generate(model, draft, tokenizer, "once upon a time", max_tokens=24, block_size=8,
                           temperature=1.0, top_p=0.9, seed=3).tokens
    want = run()
    launches = []

    def counting(**kw):
        inner = emulate.metal_kernel(**kw)

        def call(**args):
            launches.append(kw["name"])
            return inner(**args)
        return call

    others = frozenset(k for k in kernels.KERNELS if k != "verify_sampled")
    with kernels.use_policy(kernels.KernelPolicy(kernels.Backend("emulated-counting", lambda: True, counting), others)):
        got = run()
        assert vs.KERNEL.status() == "active"
    assert got == want and len(got) == 24
    assert set(launches) == {"verify_sampled"} and len(launches) > 2
