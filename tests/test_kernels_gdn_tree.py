"""The GatedDeltaNet tree kernel (metal/gdn_tree_verify.metal), proven without a Mac.

- The kernel's own source, emulated, against its reference (the level-wise
  recurrence with mlx-lm's ops) on chain, star, deep, random and best-first
  trees (``tree.build_tree``), Dk in {32, 64, 128, 256}, GQA repeats, ragged
  Dv, float32/float16/bfloat16; the reference itself against each node's path
  run as a chain.
- Each node's output is bit for bit the ``gdn_verify`` kernel's on its path.
- The host-made walk reads every node's parent state and keeps at most
  log2(N) saved states; mutations of the source fail the comparison.
- In the loop (kernels emulated behind the real dispatch): tree decoding of a
  tiny qwen3_5 target is mlx-lm greedy, token for token, and ``commit`` leaves
  the state the chain's kernels give, bit for bit.
- On-device parity (``-m metal``): only where Metal exists.

Tolerance (``GdnTreeVerify.compare``). Outputs: |kernel - reference| <=
4 Dk L 2^-24 max(1, max|context state|) + the y tolerance of test_kernels_gdn
(4 ulp float32, 2 ulp float16/bfloat16, relative), L the number of depth
levels: a node at depth d is d+1 steps from the context, each with two Dk-term
float sums that the reference adds in another order (about Dk units of 2^-24
each, on states that q, k of unit norm and decays below 1 keep of the size of
the context state or of v, both under that peak). Against gdn_verify: exact.
"""

import contextlib
import math
import shutil

import mlx.core as mx
import numpy as np
import pytest
import test_loop as chain
from checkpoints import build_target
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, gated_delta_update
from test_kernels_gdn import Counting
from test_tree_loop import BLOCK, assert_cache_close_to_fresh_feed, oracle_cycles, run

from dflash_mlx import Target, kernels, load_draft
from dflash_mlx.tree import gated_delta as tree_gated_delta
from dflash_mlx.loop.decoder import DraftProposer
from dflash_mlx.emulate import EmulationError
from dflash_mlx.kernels import gdn, gdn_tree
from dflash_mlx.kernels.emulated import emulated_backend, main, run_kernel
from dflash_mlx.kernels.gdn_tree import SLOTS, TreeIndex, random_parents
from dflash_mlx.tree.build import Tree, build_tree
from dflash_mlx.tree import TreeDecoder

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")
KERNEL = gdn_tree.KERNEL


def best_first(seed: int, budget: int = 32, positions: int = BLOCK - 1) -> list[int]:
    """A DDTree's parents: ``build_tree`` on random ranked candidates."""
    rng = np.random.default_rng(seed)
    values = -np.sort(rng.exponential(2.0, size=(positions, budget)), axis=1)
    tokens = rng.permutation(positions * budget).reshape(positions, budget)
    return build_tree(0, values.tolist(), tokens.tolist(), budget).parents


def deep(n: int, seed: int) -> list[int]:
    """Mostly a chain, branching now and then."""
    rng = np.random.default_rng(seed)
    return [-1] + [i - 1 if rng.random() < 0.8 else int(rng.integers(0, i)) for i in range(1, n)]


TREES = {
    "root only": [-1],
    "chain 16": list(range(-1, 15)),
    "star 33": [-1] + [0] * 32,
    "binary 31": [-1] + [(i - 1) // 2 for i in range(1, 31)],
    "deep 40": deep(40, 1),
    "random 33": random_parents(np.random.default_rng(2), 33),
    "best-first B32": best_first(3),
    "best-first B8": best_first(4, budget=8),
}


def path(parents: list[int], node: int) -> list[int]:
    return Tree([0] * len(parents), parents, [0] * len(parents)).path(node)


def inputs_for(parents, Hk=2, Hv=4, Dk=64, Dv=16, dtype=mx.float32, seed=0, gate_power=0.02, **kw):
    """Kernel inputs for a tree, made as a qwen3_5 layer makes them, except that
    the gates g are raised to ``gate_power``: the random layer's gates go down to
    e^-48, and a state that forgets its past in a step or two would hide a node
    started from the wrong parent; g^0.02 lies in about [0.35, 0.99]."""
    q, k, v, g, beta, state = gdn.make_inputs(np.random.default_rng(seed), B=1, T=len(parents), Hk=Hk, Hv=Hv,
                                              Dk=Dk, Dv=Dv, dtype=dtype, **kw)
    return q, k, v, g**gate_power, beta, state


# ---------------------------------------------------------------- the walk
@pytest.mark.parametrize("parents", TREES.values(), ids=TREES.keys())
def test_the_walk_reads_each_nodes_parent_state_within_log2_n_slots(parents):
    """Replays the schedule with node ids in place of states: every step must
    find its parent's id where it reads, and the slots stay within log2(N)."""
    tree = TreeIndex.of(parents)
    registers, slots, seen = -1, [None] * SLOTS, []  # -1: the context state
    for node, read, save in tree.schedule.tolist():
        parent = registers if read < 0 else slots[read]
        assert parent == parents[node], f"node {node} would start from {parent}'s state"
        registers = node
        if save >= 0:
            slots[save] = node
        seen.append(node)
    assert sorted(seen) == list(range(len(parents)))
    assert tree.slots <= max(0, math.floor(math.log2(len(parents))))
    assert max([s for row in tree.schedule.tolist() for s in row[1:]] + [-1]) == tree.slots - 1


def test_a_chain_never_saves_a_state():
    tree = TreeIndex.of(list(range(-1, 15)))
    assert tree.slots == 0 and tree.schedule.tolist() == [[n, -1, -1] for n in range(16)]


@pytest.mark.parametrize("parents", [[], [0, 0], [-1, 2, 1], [-1, 0, 5], [-1, -1]])
def test_what_is_not_a_tree_at_node_0_is_refused(parents):
    with pytest.raises(ValueError):
        TreeIndex.of(parents)


def test_the_reference_is_each_nodes_path_run_as_a_chain():
    parents = TREES["best-first B32"]
    q, k, v, g, beta, state = inputs_for(parents)
    (y,) = KERNEL.reference(q, k, v, g, beta, state, tree=TreeIndex.of(parents))
    for node in range(len(parents)):
        rows = mx.array(path(parents, node))
        want, _ = gated_delta_ops(*(t[:, rows] for t in (q, k, v, g, beta)), state)
        np.testing.assert_allclose(np.array(y[0, node]), np.array(want[0, -1]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- kernel vs reference
SHAPES = {  # (Hk, Hv, Dk, Dv)
    "Dk64 Dv16 GQA2": (2, 4, 64, 16),
    "Dk32 Dv8 GQA3": (1, 3, 32, 8),
    "Dk128 Dv32": (2, 2, 128, 32),
    "Dk256 Dv8 GQA2": (1, 2, 256, 8),
    "ragged Dv": (1, 2, 64, 13),
}


@needs_gxx
@pytest.mark.parametrize("parents", TREES.values(), ids=TREES.keys())
def test_matches_the_reference_on_every_tree_shape(parents):
    (y,), problem = run_kernel("gdn_tree_verify", *inputs_for(parents), tree=TreeIndex.of(parents))
    assert problem is None, problem


@needs_gxx
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_the_reference_on_every_head_shape(shape):
    Hk, Hv, Dk, Dv = shape
    parents = TREES["best-first B8"]
    inputs = inputs_for(parents, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, seed=Dk + Dv)
    _, problem = run_kernel("gdn_tree_verify", *inputs, tree=TreeIndex.of(parents), order="reverse")
    assert problem is None, problem


@needs_gxx
def test_the_random_layers_own_gates():
    parents = TREES["best-first B32"]
    _, problem = run_kernel("gdn_tree_verify", *inputs_for(parents, gate_power=1.0), tree=TreeIndex.of(parents))
    assert problem is None, problem


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_types(dtype):
    parents = TREES["random 33"]
    (y,), problem = run_kernel("gdn_tree_verify", *inputs_for(parents, dtype=dtype), tree=TreeIndex.of(parents))
    assert problem is None, problem
    assert y.dtype == dtype


@needs_gxx
def test_long_decay_from_a_large_state():
    """A context state with large entries and gates within 0.1% of 1, down a deep tree."""
    parents = TREES["deep 40"]
    inputs = inputs_for(parents, state_scale=30.0, seed=9, gate_power=0.001)
    _, problem = run_kernel("gdn_tree_verify", *inputs, tree=TreeIndex.of(parents))
    assert problem is None, problem


@needs_gxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("name", ["best-first B32", "binary 31", "chain 16"])
def test_each_output_is_the_verify_kernels_on_the_nodes_path(name, dtype):
    """Nodes of one depth d are a batch of paths of d+1 tokens for gdn_verify;
    its last output is the tree kernel's for that node, bit for bit."""
    parents = TREES[name]
    q, k, v, g, beta, state = inputs_for(parents, dtype=dtype, seed=5)
    (y,), _ = run_kernel("gdn_tree_verify", q, k, v, g, beta, state, tree=TreeIndex.of(parents), compare=False)
    for level in TreeIndex.of(parents).levels:
        nodes = level.tolist()
        rows = mx.array([path(parents, n) for n in nodes])  # [nodes, d+1]
        steps = [t[0][rows] for t in (q, k, v, g, beta)]
        (want, _), _ = run_kernel("gdn_verify", *steps, mx.repeat(state, len(nodes), axis=0), compare=False)
        assert mx.array_equal(y[0, level], want[:, -1]).item(), f"depth {len(rows[0]) - 1}"


# ---------------------------------------------------------------- mutations
MUTATIONS = [
    ("if (from >= 0) {", "if (from > 0) {", "slot 0 never read: a parent from the registers"),
    ("s[j] = saved[from][j];", "s[j] = saved[max(from - 1, 0)][j];", "read slot off by one"),
    ("saved[to][j] = s[j];", "saved[min(to + 1, Slots - 1)][j] = s[j];", "save slot off by one"),
    ("if (to >= 0) {", "if (to > 0) {", "slot 0 never saved"),
    ("s[j] = s[j] * decay;", "s[j] = s[j];", "decay dropped"),
    ("const float decay = g[at];", "const float decay = g[size_t(node) * Hv];", "decay of head 0"),
    ("(v[at * Dv + row] - kv) * beta[at]", "(v[at * Dv + row] - kv)", "beta dropped"),
    ("  kv += simd_shuffle_xor(kv, 8);\n", "", "butterfly level 8 (kv)"),
    ("  out += simd_shuffle_xor(out, 16);\n", "", "butterfly level 16 (y)"),
    ("const int hk = hv / (Hv / Hk);", "const int hk = hv % Hk;", "GQA head mapping"),
    ("y[at * Dv + row] = static_cast<InT>(out);", "y[(size_t(i) * Hv + hv) * Dv + row] = static_cast<InT>(out);",
     "outputs in walk order"),
    ("auto q_ = q + (size_t(node) * Hk + hk) * Dk;", "auto q_ = q + (size_t(i) * Hk + hk) * Dk;",
     "q of the walk step"),
]
MUTATION_TREE = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 3, 9, 5, 5, 7, 7, 7]


@needs_gxx
@pytest.mark.parametrize("text, replacement, what", MUTATIONS, ids=[m[2] for m in MUTATIONS])
def test_a_mutated_kernel_fails_the_comparison(text, replacement, what):
    source = KERNEL.source
    assert source.count(text) == 1, f"mutation target not found once: {text}"
    tree = TreeIndex.of(MUTATION_TREE)
    assert tree.slots >= 2 and tree.schedule[:, 0].tolist() != sorted(tree.schedule[:, 0].tolist())
    inputs = inputs_for(MUTATION_TREE, Hk=2, Hv=4, Dk=64, Dv=8, seed=11)
    _, problem = run_kernel("gdn_tree_verify", *inputs, tree=tree)
    assert problem is None
    try:
        _, problem = run_kernel("gdn_tree_verify", *inputs, tree=tree, source=source.replace(text, replacement))
    except EmulationError as e:
        problem = str(e)
    assert problem is not None, f"mutation '{what}' went unnoticed"


@needs_gxx
def test_the_self_check_input_catches_a_wrong_parent():
    inputs, params = KERNEL.sample(np.random.default_rng(0))
    source = KERNEL.source.replace("if (from >= 0) {", "if (from > 0) {")
    _, problem = run_kernel("gdn_tree_verify", *inputs, source=source, **params)
    assert problem is not None


# ---------------------------------------------------------------- dispatch
def test_uncovered_inputs_go_to_the_reference_with_a_reason():
    parents = TREES["random 33"]
    tree = TreeIndex.of(parents)
    q, k, v, g, beta, state = inputs_for(parents, Dk=32)
    why = KERNEL.unsupported
    assert why(q, k, v, g, beta, state, tree=tree) is None
    assert why(q, k, v, g, beta, state, tree=TreeIndex.of(parents[:9])) == "33 nodes of inputs for a tree of 9"
    two = [mx.repeat(t, 2, axis=0) for t in (q, k, v, g, beta, state)]
    assert why(*two, tree=tree) == "B = 2 (kernel: one tree, B = 1)"
    assert why(q, k, v, g, beta, state.astype(mx.bfloat16), tree=tree) == "state must be [B, Hv, Dv, Dk] float32"
    big = [-1] + [(i - 1) // 2 for i in range(1, 1023)]  # complete binary: log2(1023) -> 9 slots
    q9, k9, v9, g9, beta9, state9 = inputs_for(big, Hk=1, Hv=1, Dk=32, Dv=1)
    assert why(q9, k9, v9, g9, beta9, state9, tree=TreeIndex.of(big)) == \
        f"the tree needs 9 saved states per thread (kernel: at most {SLOTS})"


@needs_gxx
def test_self_check_passes_and_the_command_line_runs_it(capsys):
    with kernels.use_backend(emulated_backend(order="simdgroup")):
        assert KERNEL.status() == "active"
    assert main(["gdn_tree_verify", "--seeds", "2"]) == 0
    assert capsys.readouterr().out.count("gdn_tree_verify seed") == 2


# ---------------------------------------------------------------- in the loop
def _layer_and_cache(seed=0):
    model, _ = build_target("qwen3_5", seed=1)
    model.eval()
    gdn_layer = next(layer for layer in model.layers if getattr(layer, "is_linear", False)).linear_attn
    rng = np.random.default_rng(seed)
    cache = ArraysCache(2)
    cache[0] = mx.array(rng.normal(size=(1, gdn_layer.conv_kernel_size - 1, gdn_layer.conv_dim)).astype(np.float32))
    cache[1] = mx.array(rng.normal(size=(1, gdn_layer.num_v_heads, gdn_layer.head_v_dim,
                                         gdn_layer.head_k_dim)).astype(np.float32))
    return model, gdn_layer, cache, rng


@needs_gxx
@pytest.mark.parametrize("emulate", [True, False], ids=["kernels emulated", "no backend"])
def test_commit_is_the_chains_state_after_the_path_fed_one_token_at_a_time(emulate):
    """The committed state against the chain's own step, token by token from
    the recorded q, k, v, a, b: the verify kernel where it runs, else mlx-lm's
    ``gated_delta_update``."""
    model, layer, cache, rng = _layer_and_cache()
    parents = best_first(7, budget=12)
    tree = Tree(list(range(len(parents))), parents, [len(path(parents, n)) - 1 for n in range(len(parents))])
    x = mx.array(rng.normal(size=(1, len(parents), Target(model).hidden_size)).astype(np.float32))
    counting = Counting()
    with kernels.use_backend(counting.backend) if emulate else contextlib.nullcontext():
        _, record = tree_gated_delta.tree_attention(layer, x, tree_gated_delta.plan(tree, layer.conv_kernel_size),
                                                    cache)
        deepest = max(range(len(parents)), key=lambda n: len(path(parents, n)))
        committed = ArraysCache(2)
        tree_gated_delta.commit(committed, record, path(parents, deepest))
        state = record.state
        for n in path(parents, deepest):
            q, k, v, a, b = (t[:, n : n + 1] for t in (record.q, record.k, record.v, record.a, record.b))
            if emulate:
                g = compute_g(layer.A_log, a, layer.dt_bias)
                _, state = gdn.VERIFY.launch(q, k, v, g, mx.sigmoid(b), state)
            else:
                _, state = gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, state, None)
    assert mx.array_equal(committed[1], state).item()
    assert len(path(parents, deepest)) > 3
    assert (counting.launches.get("gdn_tree_verify", 0) > 0) == emulate


@needs_gxx
def test_tree_walks_to_every_depth_with_the_kernels_emulated():
    """Oracle drafts that leave the first child at depth 1 and at the stop:
    mlx-lm's greedy tokens, caches close to a fresh feed (test_tree_loop's
    tolerance), the recurrence through the tree kernel and commit through
    the verify kernel."""
    model, _ = build_target("qwen3_5", seed=1)
    model.eval()
    target = Target(model)
    prompt = [5, 17, 3, 99, 42, 7]
    continuation = chain.greedy_reference(model, prompt, 3 * BLOCK + 2)
    counting = Counting()
    with kernels.use_backend(counting.backend):
        for stop in (0, 1, 4, BLOCK - 1):
            second = {0, stop - 1} if stop > 1 else set()
            for decoder, out in oracle_cycles(target, prompt, continuation, stop, second):
                assert_cache_close_to_fresh_feed(target, decoder.cache, prompt + out[:-1])
    assert counting.launches["gdn_tree_verify"] > 0 and counting.launches["gdn_verify"] > 0


@needs_gxx
def test_tree_decoding_with_a_draft_is_mlx_lm_greedy(target_dirs, draft_dir):
    """The saved tiny qwen3_5 target and its draft, budget 32 (one prompt:
    emulated launches are slow)."""
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    draft = load_draft(str(draft_dir("qwen3_5", block_size=BLOCK)))
    target = Target(model)
    ids = tokenizer.encode(chain.PROMPTS[0])
    want = chain.greedy_reference(model, ids, 20)
    counting = Counting(order="simdgroup")
    with kernels.use_backend(counting.backend):
        decoder = TreeDecoder(target, DraftProposer(draft, target), draft.config.target_layer_ids,
                              BLOCK, 32, prefill_step_size=5)
        got, _ = run(decoder, ids, 20)
    chain.assert_same_or_near_tie(model, ids, got[:20], want)
    assert counting.launches["gdn_tree_verify"] > 0


# ---------------------------------------------------------------- on a Mac
@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="on-device parity needs Metal")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(16, 32, 128, 128), (16, 48, 128, 128), (2, 4, 64, 32)],
                         ids=["qwen3.5-9B", "qwen3.5-27B", "small"])
def test_on_device_parity(dtype, shape):
    """The compiled kernel (``pytest -m metal``) on a best-first B = 32 tree:
    against its reference, and each output bit for bit the compiled verify
    kernel's on the node's path."""
    Hk, Hv, Dk, Dv = shape
    parents = best_first(0)
    tree = TreeIndex.of(parents)
    q, k, v, g, beta, state = inputs_for(parents, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype)
    got = KERNEL.launch(q, k, v, g, beta, state, tree=tree)
    want = KERNEL.reference(q, k, v, g, beta, state, tree=tree)
    assert KERNEL.compare(got, want, (q, k, v, g, beta, state), {"tree": tree}) is None
    for node in range(len(parents)):
        rows = mx.array(path(parents, node))
        y, _ = gdn.VERIFY.launch(*(t[:, rows] for t in (q, k, v, g, beta)), state)
        assert mx.array_equal(got[0][0, node], y[0, -1]).item(), f"node {node}"
