"""A DSpark draft on a Gemma 4 target: the draft's block goes through the
target's scaled embeddings and its soft-capped tied head (``Target.embed``,
``Target.logits``), the Markov walk runs over those capped logits, and the
output stays mlx-lm's greedy output at every acceptance length. The draft is
test_dspark.py's tiny DeepSpec-layout draft written for the tiny ``gemma4``
target (per-layer inputs, KV-shared layers); Gemma 4's own packaging
(``Gemma4DSparkModel``) is refused at load, as test_dspark.py shows."""

import json

import pytest
from test_dspark import GAMMA, assert_every_acceptance_length, greedy_reference, write_dspark_draft

from dflash_mlx import generate, load, load_draft
from dflash_mlx.draft import DSparkDraft


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory, target_dirs):
    model, tokenizer = load(str(target_dirs["gemma4"]))
    path = tmp_path_factory.mktemp("dspark-gemma4")
    write_dspark_draft(path, model, json.loads((target_dirs["gemma4"] / "config.json").read_text()))
    return model, tokenizer, path


def test_greedy_output_is_mlx_lm_greedy_output(gemma4):
    model, tokenizer, path = gemma4
    draft = load_draft(str(path))
    assert isinstance(draft, DSparkDraft) and draft.markov_head is not None
    ids = tokenizer.encode("the quick brown fox")
    want = greedy_reference(model, ids, 24)
    assert len(set(want)) > 8, "fixture too degenerate to prove anything"
    for block_size in (2, GAMMA + 1):
        assert generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size).tokens == want


def test_every_acceptance_length_stays_lossless(gemma4):
    model, tokenizer, path = gemma4
    assert_every_acceptance_length(model, tokenizer, path)
