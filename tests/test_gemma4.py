"""Gemma 4 targets (docs/targets.md, "Gemma 4"): lossless against mlx-lm with
per-layer inputs and KV-shared layers on, exact rollback at every acceptance
length (only the layers owning a cache roll back; the sharing layers read the
rolled-back state), the tapped features, and the draft's borrowed embeddings
and soft-capped logits against their equations."""

import math

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from test_loop import (
    assert_same_or_near_tie, check_greedy_output, check_rollback_at_every_acceptance_length, greedy_reference,
)

from dflash_mlx import Target, generate, load_draft
from dflash_mlx.loop.decoder import DraftProposer
from dflash_mlx.registry import find_draft

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def gemma(target_dirs, draft_dir):
    """family -> (model, tokenizer, draft) for both Gemma 4 checkpoint types."""
    out = {}
    for family in ("gemma4", "gemma4_text"):
        model, tokenizer = mlx_lm_load(str(target_dirs[family]))
        draft = load_draft(str(draft_dir(family, block_size=16, layer_types=["sliding_attention", "full_attention"],
                                         sliding_window=5, target_layer_ids=[1, 4])))
        out[family] = (model, tokenizer, draft)
    return out


def test_the_fixture_shares_kv_and_feeds_per_layer_inputs(gemma):
    model = gemma["gemma4"][0]
    inner = model.language_model.model
    assert inner.hidden_size_per_layer_input > 0
    assert inner.previous_kvs == [0, 1, 2, 3, 2, 3]  # layers 4 and 5 attend over layers 2 and 3's K/V
    assert len(Target(model).make_cache()) == 4


@pytest.mark.parametrize("block_size", [3, 16])
def test_greedy_output_is_mlx_lm_greedy_output(gemma, block_size):
    model, tokenizer, draft = gemma["gemma4"]
    check_greedy_output(model, tokenizer, draft, PROMPT, block_size)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_text"])
def test_rollback_at_every_acceptance_length(gemma, family):
    """After each cycle the owning layers' caches are bit-identical to ones fed
    only the accepted tokens, and the output (which the sharing layers shape)
    is mlx-lm's own greedy continuation."""
    model, tokenizer, _ = gemma[family]
    check_rollback_at_every_acceptance_length(model, tokenizer, 6)


def test_features_are_the_outputs_of_the_tapped_layers(gemma, target_dirs):
    """Layer 4 reads layer 2's K/V: its output in the features is what mlx-lm's
    own forward, cut after layer 4, gives."""
    model, tokenizer, draft = gemma["gemma4"]
    target = Target(model)
    ids = mx.array(tokenizer.encode("write a short story about a cat who"))[None]
    features = target.forward(ids, target.make_cache(), [1, 4]).features
    H = target.hidden_size
    for k, layer_id in enumerate([1, 4]):
        cut, _ = mlx_lm_load(str(target_dirs["gemma4"]))
        inner = cut.language_model.model
        inner.layers = inner.layers[: layer_id + 1]
        inner.norm = lambda h: h
        want = inner(ids)
        assert mx.allclose(features[..., k * H : (k + 1) * H], want, rtol=1e-5, atol=1e-5).item()


def test_the_draft_borrows_scaled_embeddings_and_the_softcapped_tied_head(gemma):
    """propose() = 30 tanh(E h / 30) over the draft's hidden states for the block
    embedded as E[ids] * sqrt(hidden_size), E the target's tied embedding."""
    model, tokenizer, draft = gemma["gemma4"]
    target = Target(model)
    E = model.language_model.model.embed_tokens.weight
    H, cap = target.hidden_size, model.language_model.args.final_logit_softcapping
    assert cap == 30.0
    prompt = mx.array(tokenizer.encode(PROMPT))
    features = target.forward(prompt[None], target.make_cache(), draft.config.target_layer_ids).features
    proposer = DraftProposer(draft, target)
    proposer.observe(features, prompt)
    y, b = mx.array([17]), 8
    got = proposer.propose(y, b)

    block = mx.concatenate([y, mx.full((b - 1,), draft.config.mask_token_id, dtype=y.dtype)])
    embeddings = E[block][None] * math.sqrt(H)
    assert mx.allclose(target.embed(block[None]), embeddings, rtol=1e-6, atol=1e-6).item()
    cache = draft.make_cache()
    draft.inject(features, cache)
    hidden = draft(embeddings, cache)[0, 1:]
    want = cap * mx.tanh((hidden @ E.T) / cap)
    assert got.shape == (b - 1, target.vocab_size)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()
    assert mx.max(mx.abs(got)).item() < cap
    assert not mx.allclose(hidden @ E.T, want, rtol=1e-5, atol=1e-4).item()  # a missing cap would show
    unscaled = draft.make_cache()
    draft.inject(features, unscaled)
    assert not mx.allclose(draft(E[block][None], unscaled)[0, 1:], hidden, rtol=1e-3, atol=1e-3).item()  # and the scale


@pytest.mark.parametrize("target, draft", [
    ("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    ("mlx-community/gemma-4-26b-a4b-it-4bit", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    ("mlx-community/gemma-4-31b-it-8bit", "z-lab/gemma-4-31B-it-DFlash"),
])
def test_the_registry_knows_the_published_gemma4_drafts(target, draft):
    assert find_draft(target) == draft


def test_tree_walk_to_every_depth_keeps_mlx_lm_output_and_the_owners_caches(gemma):
    """DDTree over Gemma 4: each layer called with its per-layer input and the
    K/V its owner produced in the same tree pass, nodes rotated at their depth;
    the path left at depth 1 and ``stop`` is followed, and the owning layers'
    caches end as a fresh feed of the committed tokens leaves them."""
    from test_tree_loop import BLOCK, assert_cache_close_to_fresh_feed, oracle_cycles

    model, tokenizer, _ = gemma["gemma4"]
    target = Target(model)
    prompt = tokenizer.encode(PROMPT)
    continuation = greedy_reference(model, prompt, 3 * BLOCK + 2)
    for stop in (0, 1, BLOCK // 2, BLOCK - 1):
        second = {0, stop - 1} if stop > 1 else set()
        for decoder, out in oracle_cycles(target, prompt, continuation, stop, second):
            assert_cache_close_to_fresh_feed(target, decoder.cache, prompt + out[:-1])


def test_tree_generation_is_mlx_lm_greedy_output(gemma):
    model, tokenizer, draft = gemma["gemma4"]
    ids = tokenizer.encode(PROMPT)
    res = generate(model, draft, tokenizer, PROMPT, max_tokens=32, block_size=8, tree_budget=8)
    assert_same_or_near_tie(model, ids, res.tokens, greedy_reference(model, ids, 32))


def test_a_draft_config_that_names_the_scale_and_cap_gets_them_once(gemma, draft_dir, tmp_path):
    """A Gemma 4 draft config carrying ``final_logit_softcapping`` 30 (as the
    published drafts do) and ``input_embedding_scale`` sqrt(H): the draft applies
    them to the table's rows and the head's raw output, so its logits are the
    same single scale and single cap as a draft that names neither."""
    import json
    import shutil

    model, tokenizer, plain = gemma["gemma4"]
    target = Target(model)
    source = draft_dir("gemma4", block_size=16, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=5, target_layer_ids=[1, 4])
    shutil.copytree(source, tmp_path / "named")
    config = json.loads((tmp_path / "named" / "config.json").read_text())
    config["dflash_config"].update(final_logit_softcapping=30.0, input_embedding_scale=math.sqrt(target.hidden_size))
    (tmp_path / "named" / "config.json").write_text(json.dumps(config))
    named = load_draft(str(tmp_path / "named"))
    prompt = mx.array(tokenizer.encode(PROMPT))
    features = target.forward(prompt[None], target.make_cache(), plain.config.target_layer_ids).features
    logits = []
    for draft in (plain, named):
        proposer = DraftProposer(draft, target)
        proposer.observe(features, prompt)
        logits.append(proposer.propose(mx.array([17]), 8))
    assert mx.allclose(logits[0], logits[1], rtol=1e-5, atol=1e-4).item()
