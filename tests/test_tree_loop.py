"""The DDTree cycle: lossless against mlx-lm greedy on every family (attention
and GatedDeltaNet hybrids), walks through non-first children to every depth,
and caches after each commit close to a fresh feed of the committed tokens."""

import shutil

import mlx.core as mx
import pytest
import test_loop as chain
from checkpoints import build_target
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx import Target, load_draft
from dflash_mlx.loop.decoder import DraftProposer
from dflash_mlx.errors import DFlashError
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams
from dflash_mlx.tree.attention import PositionedRope, compact, tree_mask
from dflash_mlx.tree import TreeDecoder

FAMILIES = ["llama", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe"]
BLOCK = 16


@pytest.fixture(scope="module")
def loaded(target_dirs, draft_dir):
    """family -> (mlx-lm model, tokenizer, draft)."""
    out = {}
    for family in FAMILIES:
        model, tokenizer = mlx_lm_load(str(target_dirs[family]))
        out[family] = (model, tokenizer, load_draft(str(draft_dir(family, block_size=BLOCK))))
    return out


def run(decoder, prompt, n):
    out, accepted = [decoder.prefill(mx.array(prompt))], []
    while len(out) < n:
        cycle = decoder.cycle()
        out += cycle.tokens
        accepted.append(cycle.accepted)
    return out, accepted


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [4, 16, 32])
def test_tree_greedy_output_is_mlx_lm_greedy_output(loaded, family, budget):
    model, tokenizer, draft = loaded[family]
    target = Target(model)
    for prompt in chain.PROMPTS:
        ids = tokenizer.encode(prompt)
        want = chain.greedy_reference(model, ids, 48)
        decoder = TreeDecoder(target, DraftProposer(draft, target), draft.config.target_layer_ids,
                              BLOCK, budget, prefill_step_size=5)
        got, _ = run(decoder, ids, 48)
        chain.assert_same_or_near_tie(model, ids, got[:48], want)


# A compacted row is the tree pass's row bit for bit (test_compact_*). Against a
# fresh feed the passes differ in shape (N tree rows vs the committed rows), so a
# BLAS may round each float32 matmul (unit roundoff 2^-24) differently, and
# layers and the GatedDeltaNet recurrence accumulate it: measured 0 with MLX's
# own CPU BLAS and at most 2^-16 of a tensor's largest entry with OpenBLAS.
# 2^-12 of that scale leaves 16x margin; a wrong row, position or path moves
# entries by the order of the scale itself.
FRESH_FEED_TOLERANCE = 2.0**-12


def assert_cache_close_to_fresh_feed(target, cache, committed):
    fresh = target.make_cache()
    target.forward(mx.array(committed)[None], fresh, [0])
    for i, (c, f) in enumerate(zip(cache, fresh)):
        if isinstance(c, KVCache):
            assert c.offset == f.offset == len(committed), f"layer {i} offset"
            arrays = zip(c.keys_and_values(), f.keys_and_values())
        else:  # GatedDeltaNet: conv window and recurrent state
            arrays = zip(c.cache, f.cache)
        for a, b in arrays:
            assert a.shape == b.shape, f"layer {i}"
            scale = mx.abs(b).max().item()
            assert mx.abs(a - b).max().item() <= FRESH_FEED_TOLERANCE * scale, f"layer {i}"


class TreeOracle:
    """Draft distributions that put the target's greedy continuation at rank 1
    (second) where ``second`` says, at rank 0 elsewhere, and out of the tree
    from position ``stop`` on."""

    def __init__(self, prompt_len, continuation, stop, second, vocab_size):
        self.position, self.prompt_len = 0, prompt_len
        self.continuation, self.stop, self.second = continuation, stop, second
        self.vocab_size = vocab_size

    def observe(self, features, tokens):
        self.position += tokens.size

    def propose(self, y, block_size):
        start = self.position - self.prompt_len + 1
        rows = []
        for d in range(block_size - 1):
            right = self.continuation[start + d]
            wrong = (right + 1) % self.vocab_size
            row = mx.full((self.vocab_size,), -30.0)
            if d >= self.stop:
                row[right] = -40.0
            elif d in self.second:
                row[wrong], row[right] = 0.0, -0.5
            else:
                row[right], row[wrong] = 0.0, -3.0
            rows.append(row)
        return mx.stack(rows)


def oracle_cycles(target, prompt, continuation, stop, second, block=BLOCK, budget=32, cycles=2, **options):
    """Tree cycles drafted by a ``TreeOracle``: each must accept exactly ``stop``
    tokens and keep the output on ``continuation``; yields (decoder, output so
    far) after every cycle for further checks."""
    oracle = TreeOracle(len(prompt), continuation, stop, second, target.vocab_size)
    decoder = TreeDecoder(target, oracle, [0], block, budget, **{"prefill_step_size": 3, **options})
    out = [decoder.prefill(mx.array(prompt))]
    for _ in range(cycles):
        cycle = decoder.cycle()
        assert cycle.accepted == stop
        out += cycle.tokens
        assert out == continuation[: len(out)]
        yield decoder, out


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "qwen3_moe", "qwen3_5"])
def test_tree_walk_follows_non_first_children_to_every_depth(loaded, family):
    model, tokenizer, _ = loaded[family]
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    continuation = chain.greedy_reference(model, prompt, 3 * BLOCK + 2)
    budget = 32
    for stop in range(BLOCK):  # the path leaves the first child at depths 1 and stop
        second = {0, stop - 1} if stop > 1 else set()
        for decoder, out in oracle_cycles(target, prompt, continuation, stop, second, budget=budget):
            assert_cache_close_to_fresh_feed(target, decoder.cache, prompt + out[:-1])
            assert decoder.tokens == prompt + out[:-1]


def test_compact_keeps_the_path_rows_bit_for_bit_and_trims_the_rest():
    cache = KVCache()
    keys = mx.random.normal((1, 2, 9, 4), key=mx.random.key(1))
    values = mx.random.normal((1, 2, 9, 4), key=mx.random.key(2))
    cache.update_and_fetch(keys, values)
    path = [0, 2, 3, 5]  # rows of the 6-node tree appended after 3 context rows
    compact(cache, 3, path)
    k, v = cache.keys_and_values()
    rows = [0, 1, 2] + [3 + p for p in path]
    assert cache.offset == 7
    assert mx.array_equal(k, keys[..., rows, :]) and mx.array_equal(v, values[..., rows, :])
    cache.update_and_fetch(keys[..., :1, :], values[..., :1, :])  # the next pass appends after the path
    assert mx.array_equal(cache.keys_and_values()[0][..., 7, :], keys[..., 0, :])


def test_tree_mask_of_a_chain_is_the_causal_mask():
    n, offset = 6, 5
    parents, depths = list(range(-1, n - 1)), list(range(n))
    for window in [None, 3]:
        want = create_causal_mask(n, offset, window_size=window)
        assert mx.array_equal(tree_mask(parents, depths, offset, window), want)


def test_tree_mask_sees_context_ancestors_and_self_within_the_window():
    # root 0; 1, 2 children of 0; 3 child of 1; 4 child of 3
    parents, depths = [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3]
    mask = tree_mask(parents, depths, 2, None)
    assert mask[:, :2].all().item()
    want = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    assert mask[:, 2:].tolist() == [[bool(v) for v in row] for row in want]
    # window 2 by position: node 4 (position 5) sees positions 4 and 5 only
    sliding = tree_mask(parents, depths, 2, 2)
    assert sliding[4].tolist() == [False] * 5 + [True, True]
    # node 2 (position 3) sees the root (position 2) and itself, not context position 1
    assert sliding[2].tolist() == [False, False, True, False, True, False, False]


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_positioned_rope_rotates_each_token_at_its_position(scaling):
    rope = initialize_rope(16, 10000.0, False, scaling, max_position_embeddings=1024)
    x = mx.random.normal((1, 3, 5, 16), key=mx.random.key(0))
    positions = mx.array([7, 8, 8, 9, 12])
    got = PositionedRope(rope, positions)(x, offset=7)
    for t in range(5):
        want = rope(x[:, :, t : t + 1], offset=positions[t].item())
        assert mx.array_equal(got[:, :, t : t + 1], want), t


def test_tree_decoder_refuses_what_it_cannot_verify(loaded):
    model, _ = build_target("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    target = Target(model)
    with pytest.raises(DFlashError, match="RoPE .DynamicNTKScalingRoPE"):
        TreeDecoder(target, DraftProposer(loaded["llama"][2], target), [0], BLOCK, 8)


def test_logits_processors_see_each_nodes_own_path(loaded):
    """With a repetition penalty every node's logits are processed with the
    committed tokens and its own path as history, as mlx-lm's decoding does."""
    model, tokenizer, _ = loaded["llama"]
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    processors = make_logits_processors(repetition_penalty=3.0, repetition_context_size=6)
    continuation = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=3 * BLOCK + 2,
                                                 logits_processors=processors)]
    assert continuation != chain.greedy_reference(model, prompt, 3 * BLOCK + 2)  # the penalty bites
    sampler = lambda: BlockSampler(SamplingParams(repetition_penalty=3.0, repetition_context_size=6))
    for stop in [3, BLOCK - 1]:
        list(oracle_cycles(target, prompt, continuation, stop, {0, stop - 1}, sampler=sampler()))


def test_a_quantized_kv_cache_is_compacted_to_the_path(tmp_path):
    """mlx-lm's QuantizedKVCache (keys and values as packed tuples): walks to
    several depths give mlx-lm's greedy output with the same caches, and the
    caches hold exactly the committed positions."""
    from checkpoints import write_target

    write_target(tmp_path / "target", "llama", num_hidden_layers=2, head_dim=32)
    model, tokenizer = mlx_lm_load(str(tmp_path / "target"))
    model.make_cache = lambda: [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    continuation = chain.greedy_reference(model, prompt, 3 * BLOCK + 2)
    for stop in [0, 2, 5, BLOCK - 1]:
        for decoder, out in oracle_cycles(target, prompt, continuation, stop, {0, stop - 1} if stop > 1 else set()):
            assert all(type(c) is QuantizedKVCache for c in decoder.cache)
            assert all(c.offset == len(prompt) + len(out) - 1 for c in decoder.cache)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")
def test_a_quantized_targets_tree_pass_runs_its_matmuls_through_the_verify_kernel():
    """4-bit qwen3_5 target, kernels emulated: every cycle's tree pass runs the
    layers' quantized matmuls through qmm_verify (not only the LM head), and the
    output is mlx-lm's greedy output through non-first children."""
    import mlx.nn as nn
    from test_kernels_gdn import Counting, _qwen3_5

    from dflash_mlx import kernels

    model = _qwen3_5(quantized=True)
    target = Target(model)
    quantized_linears = sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    prompt = [11, 200, 3, 47, 5]
    continuation = chain.greedy_reference(model, prompt, 2 * 8 + 2)
    counting = Counting()
    with kernels.use_backend(counting.backend):
        list(oracle_cycles(target, prompt, continuation, 3, {0, 2}, block=8, budget=16, prefill_step_size=64))
    # per cycle: every swapped layer of the pass plus the LM head; the prefill
    # adds its logits row only (without the tree pass's swap: 3 launches in all)
    assert counting.launches["qmm_verify"] >= 2 * (quantized_linears + 1)
