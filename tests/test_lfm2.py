"""LFM2 targets (mlx-lm's ``lfm2`` and ``lfm2_moe``; docs/targets.md, "LFM2"):
short-convolution layers beside attention, run through the short-convolution layer kind; exact
rollback at every kept length, lossless against mlx-lm's greedy output at every
acceptance length, with a DFlash draft and with a DSpark draft in LiquidAI's
packaging on its own kind of target. Each target is a tiny checkpoint
saved by mlx-lm's writers (``checkpoints.py``) and loaded as a user's is, by
``dflash_mlx.load``."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.lfm2 import ShortConv as ShortConvLayer
from test_dspark import assert_every_acceptance_length, write_dspark_draft
from test_dspark_packaging import LIQUID_GAMMA, write_liquid
from test_loop import (
    check_greedy_output, check_recording_forward_matches_the_plain_forward, check_rollback_at_every_acceptance_length,
    greedy_reference,
)

from dflash_mlx import DFlashError, Target, batch_generate, generate, load, load_draft
from dflash_mlx.draft import DSparkDraft
from dflash_mlx.targets.layer_kinds import Attention
from dflash_mlx.targets.short_conv import SHORT_CONV

# interleaved RoPE (LiquidAI's): the draft's KV injection runs layer by layer, and says so once
pytestmark = pytest.mark.filterwarnings("ignore:dflash-mlx. KV injection runs layer by layer")

FAMILIES = ["lfm2", "lfm2_moe"]
PROMPT = "write a short story about a cat who"
BLOCK = 8  # the verify block of the rollback tests


@pytest.fixture(scope="module")
def loaded(target_dirs, draft_dir):
    """family -> (model, tokenizer, DFlash draft)."""
    out = {}
    for family in FAMILIES:
        model, tokenizer = load(str(target_dirs[family]))
        out[family] = (model, tokenizer, load_draft(str(draft_dir(family, block_size=16))))
    return out


@pytest.fixture(scope="module")
def lfm2(loaded):
    return loaded["lfm2"]


@pytest.fixture(scope="module")
def liquid(tmp_path_factory, target_dirs, lfm2):
    """A random DSpark draft for the lfm2 target in LiquidAI's on-disk layout (no
    embedding or head: the target's are borrowed)."""
    root = tmp_path_factory.mktemp("liquid-lfm2")
    config = json.loads((target_dirs["lfm2"] / "config.json").read_text())
    write_dspark_draft(root / "source", lfm2[0], config, gamma=LIQUID_GAMMA)
    write_liquid(root / "source", root / "liquid")
    return root / "liquid"


def test_its_layers_are_short_convolutions_and_attention(loaded):
    model = loaded["lfm2"][0]
    target = Target(model)
    assert target.kinds == [SHORT_CONV, SHORT_CONV, Attention("full_attention"), SHORT_CONV,
                            Attention("full_attention"), SHORT_CONV]
    assert Target(loaded["lfm2_moe"][0]).kinds == [SHORT_CONV, Attention("full_attention"), SHORT_CONV, SHORT_CONV]
    assert target.final_norm is model.model.embedding_norm  # lfm2's name for its final norm
    hidden = mx.random.normal((1, 3, target.hidden_size))
    assert mx.array_equal(target.logits(hidden), model.model.embed_tokens.as_linear(hidden)).item()  # tied


@pytest.mark.parametrize("family", FAMILIES)
def test_recording_forward_matches_the_plain_forward(loaded, family):
    model, tokenizer, _ = loaded[family]
    check_recording_forward_matches_the_plain_forward(model, tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_to_every_kept_length_is_feeding_the_kept_tokens_alone(loaded, family):
    """After a recorded pass over a block of 8, rolling back to keep = 1..8 leaves
    every conv window and K/V cache as feeding only the first ``keep`` tokens
    does: the same offsets and shapes, and values equal up to the matmuls'
    rounding over another number of rows (the right-padded test below is
    bit-exact); a window one row off is told apart."""
    model, tokenizer, _ = loaded[family]
    target = Target(model)
    prompt = mx.array(tokenizer.encode("the quick brown fox jumps"))[None]
    block = mx.array(tokenizer.encode(" over the lazy dog hello world what is", add_special_tokens=False)[:BLOCK])
    assert block.size == BLOCK
    for keep in range(1, BLOCK + 1):
        rolled, alone = target.make_cache(), target.make_cache()
        for cache in (rolled, alone):
            target.forward(prompt, cache, [0])
        forward = target.forward(block[None], rolled, [0], record=True)
        target.rollback(rolled, forward, keep)
        target.forward(block[None, :keep], alone, [0])
        for i, (got, want, kind) in enumerate(zip(rolled, alone, target.kinds)):
            if kind is SHORT_CONV:
                assert got[0].shape == want[0].shape and mx.allclose(got[0], want[0], rtol=1e-4, atol=1e-4).item(), i
                shifted = forward.records[i].conv_input[:, keep - 1 : keep + 1]  # one row early
                assert not mx.allclose(shifted, want[0], atol=1e-3).item()
            else:
                assert got.offset == want.offset == prompt.shape[1] + keep
                for a, b in zip(got.keys_and_values(), want.keys_and_values()):
                    assert a.shape == b.shape and mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), i


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [5, 9])
def test_rollback_at_every_acceptance_length(loaded, family, block_size):
    """An oracle proposer accepts 0..block_size - 1 drafts and the full block in
    turn: the output is mlx-lm's greedy continuation, and after each cycle every
    cache is bit-identical to one fed the same block with only the accepted
    tokens kept (mlx-lm's right padding, which its ShortConv honours)."""
    model, tokenizer, _ = loaded[family]
    check_rollback_at_every_acceptance_length(model, tokenizer, block_size)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [2, 4, 16, "auto"])
def test_greedy_output_is_mlx_lm_greedy_output(loaded, family, block_size):
    """auto (the default) measures the pair's cost curve first, through the target's own final norm."""
    model, tokenizer, draft = loaded[family]
    check_greedy_output(model, tokenizer, draft, PROMPT, block_size)


def test_batch_rows_roll_back_on_their_own(lfm2):
    """The batch decoder's rows (each its own conv window, rolled back to its own
    kept length) give every request its solo output."""
    model, tokenizer, draft = lfm2
    prompts = ["the quick brown fox", "hello", PROMPT]
    results = batch_generate(model, draft, tokenizer, prompts, max_tokens=[20, 9, 14], block_size=4)
    for prompt, limit, result in zip(prompts, [20, 9, 14], results):
        assert result.tokens == generate(model, draft, tokenizer, prompt, max_tokens=limit, block_size=4).tokens


class LoudShortConv(ShortConvLayer):
    """mlx-lm's conv layer as a future release might change it: the model's own
    forward runs this, the adapter's recording copy does not."""

    def __call__(self, *args, **kwargs):
        return 1.5 * super().__call__(*args, **kwargs)


def test_a_changed_conv_layer_stops_generation(target_dirs, draft_dir):
    """The load-time forward check guards the recording copy of the conv layer."""
    model, tokenizer = load(str(target_dirs["lfm2"]))  # a fresh instance: checked again
    model.layers[0].conv.__class__ = LoudShortConv  # this instance only
    with pytest.raises(DFlashError, match="differs from the model's own") as e:
        generate(model, load_draft(str(draft_dir("lfm2", block_size=16))), tokenizer, PROMPT, max_tokens=4)
    assert "\n" not in str(e.value)


def test_a_tree_budget_is_refused_in_one_line(lfm2):
    model, tokenizer, draft = lfm2
    with pytest.raises(DFlashError, match="short_conv layers") as e:
        generate(model, draft, tokenizer, PROMPT, max_tokens=4, block_size=4, tree_budget=8)
    assert "\n" not in str(e.value)


def test_liquids_dspark_draft_runs_on_an_lfm2_target(lfm2, liquid):
    """LiquidAI's packaging (gamma 9, interleaved RoPE, the target's embedding and
    head) on an lfm2 target: mlx-lm's greedy output at blocks 2 and gamma + 1."""
    model, tokenizer, _ = lfm2
    draft = load_draft(str(liquid))
    assert isinstance(draft, DSparkDraft) and draft.config.block_size == LIQUID_GAMMA + 1
    for text in ("the quick brown fox", "hello world what is"):
        ids = tokenizer.encode(text)
        want = greedy_reference(model, ids, 24)
        for block_size in (2, LIQUID_GAMMA + 1):
            assert generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size).tokens == want


def test_liquids_dspark_draft_is_lossless_at_every_acceptance_length(lfm2, liquid):
    model, tokenizer, _ = lfm2
    assert_every_acceptance_length(model, tokenizer, liquid)
