"""Qwen3-Next targets (docs/targets.md, "Qwen3-Next"): the GatedDeltaNet layer
kind of qwen3_5 behind the head-grouped qkvz/ba projections; lossless against
mlx-lm on the chain and the DDTree, exact rollback at every acceptance length."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from test_loop import (
    assert_same_or_near_tie, check_greedy_output, check_recording_forward_matches_the_plain_forward,
    check_rollback_at_every_acceptance_length, greedy_reference,
)

from dflash_mlx import Target, load_draft
from dflash_mlx.loop.decoder import DraftProposer
from dflash_mlx.registry import find_draft
from dflash_mlx.targets import GatedDelta
from dflash_mlx.tree import TreeDecoder

PROMPT = "write a short story about a cat who"


@pytest.fixture(scope="module")
def qwen3_next(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_next"]))
    return model, tokenizer, load_draft(str(draft_dir("qwen3_next", block_size=16)))


def test_its_linear_layers_are_the_gated_delta_kind(qwen3_next):
    model = qwen3_next[0]
    kinds = Target(model).kinds
    assert [isinstance(k, GatedDelta) for k in kinds] == [True, False, True, False]
    assert all(hasattr(layer.linear_attn, "in_proj_qkvz") for layer in model.layers[::2])


def test_recording_forward_matches_the_plain_forward(qwen3_next):
    model, tokenizer, _ = qwen3_next
    check_recording_forward_matches_the_plain_forward(model, tokenizer)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_output_is_mlx_lm_greedy_output(qwen3_next, block_size):
    model, tokenizer, draft = qwen3_next
    check_greedy_output(model, tokenizer, draft, PROMPT, block_size)


def test_tree_greedy_output_is_mlx_lm_greedy_output(qwen3_next):
    model, tokenizer, draft = qwen3_next
    target = Target(model)
    ids = tokenizer.encode(PROMPT)
    want = greedy_reference(model, ids, 32)
    decoder = TreeDecoder(target, DraftProposer(draft, target), draft.config.target_layer_ids, 16, 16,
                          prefill_step_size=5)
    got = [decoder.prefill(mx.array(ids))]
    while len(got) < 32:
        got += decoder.cycle().tokens
    assert_same_or_near_tie(model, ids, got[:32], want)


def test_rollback_at_every_acceptance_length(qwen3_next):
    """After each cycle the cache is bit-identical to one fed only the accepted
    tokens (mlx-lm's right padding), and the output is mlx-lm's greedy one."""
    model, tokenizer, _ = qwen3_next
    check_rollback_at_every_acceptance_length(model, tokenizer, 6)


def test_the_registry_knows_the_published_qwen3_coder_next_draft():
    assert find_draft("mlx-community/Qwen3-Coder-Next-4bit") == "z-lab/Qwen3-Coder-Next-DFlash"
