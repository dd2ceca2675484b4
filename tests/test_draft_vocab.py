"""A reduced drafting vocabulary (``draft/vocab.py``): the ranking is made from
a corpus and stored beside the draft, the sliced head equals the full head on
its ids and proposes nothing else, and output stays lossless: mlx-lm's greedy
tokens (chain and tree) and the target's distribution under sampling."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import test_loop as chain
import test_sampling as sampled
from checkpoints import build_target
from mlx_lm import load as mlx_lm_load
from typer.testing import CliRunner
from test_sampling import model  # noqa: F401,F811 (the fixture: a tiny hybrid with 16 ids)

from dflash_mlx import Target, generate, load_draft
from dflash_mlx.loop.decoder import DraftProposer
from dflash_mlx.draft.vocab import RANKING_FILE, SubsetHead, rank_tokens, read_ranking, subset_head, write_ranking
from dflash_mlx.cli import app
from dflash_mlx.errors import DFlashError


def test_ranking_is_every_id_most_frequent_first_ties_by_id():
    ranking = rank_tokens([5, 3, 5, 7, 3, 5, 1], vocab_size=8)
    assert ranking.tolist() == [5, 3, 1, 7, 0, 2, 4, 6]
    with pytest.raises(DFlashError, match="outside the vocabulary of 8"):
        rank_tokens([8], vocab_size=8)


def test_ranking_round_trips_beside_the_draft_and_load_draft_reads_it(tmp_path, draft_dir):
    draft = tmp_path / "draft"
    shutil.copytree(draft_dir("qwen3"), draft)
    assert load_draft(str(draft)).vocab_ranking is None
    ranking = rank_tokens(range(50), 300)
    write_ranking(draft, ranking)
    assert sorted(p.name for p in draft.iterdir() if p.name.startswith((".", "draft_vocab"))) == [RANKING_FILE]
    np.testing.assert_array_equal(load_draft(str(draft)).vocab_ranking, ranking)
    (draft / RANKING_FILE).write_bytes(b"not safetensors")
    with pytest.raises(DFlashError, match="is not a draft vocabulary ranking"):
        read_ranking(draft)


def quantized(model):
    nn.quantize(model, group_size=32, bits=4)
    return model


HEADS = {  # name -> a target whose LM head is of that kind
    "linear": lambda: build_target("llama", seed=0, tie_word_embeddings=False)[0],
    "tied embedding": lambda: build_target("qwen3", seed=0, tie_word_embeddings=True)[0],
    "4-bit linear": lambda: quantized(build_target("llama", seed=0, tie_word_embeddings=False)[0]),
    "4-bit tied": lambda: quantized(build_target("qwen3", seed=0, tie_word_embeddings=True)[0]),
    "soft-capped tied (gemma4)": lambda: build_target("gemma4", seed=0)[0],
}


@pytest.mark.parametrize("kind", list(HEADS))
def test_the_sliced_head_is_the_full_head_on_its_ids_and_minus_inf_elsewhere(kind):
    target = Target(HEADS[kind]())
    ids = mx.array(np.sort(np.random.default_rng(0).choice(target.vocab_size, 40, replace=False)))
    hidden = mx.array(np.random.default_rng(1).normal(size=(1, 7, target.hidden_size)).astype(np.float32))
    got, full = SubsetHead(target, ids).logits(hidden), target.logits(hidden)
    assert got.shape == full.shape
    inside = np.zeros(target.vocab_size, dtype=bool)
    inside[np.array(ids)] = True
    np.testing.assert_allclose(np.array(got)[..., inside], np.array(full)[..., inside], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(np.array(got)[..., ~inside]))
    raw = np.array(SubsetHead(target, ids).head_logits(hidden))
    np.testing.assert_allclose(raw[..., inside], np.array(target.head_logits(hidden))[..., inside], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(raw[..., ~inside]))
    if "gemma4" in kind:  # the cap is applied to the kept ids, and it changes them
        assert not np.allclose(raw[..., inside], np.array(got)[..., inside], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("draft_cap", [None, 30.0])
def test_on_a_gemma4_target_the_subset_draft_logits_are_the_full_ones_capped_once(target_dirs, draft_dir, draft_cap):
    """A Gemma 4 draft over a reduced vocabulary, whether its config names the
    cap (as the published drafts do) or not: its logits on the kept ids are
    those over the full head (the target's cap applied once), -inf elsewhere."""
    model, tokenizer = mlx_lm_load(str(target_dirs["gemma4"]))
    draft = load_draft(str(draft_dir("gemma4", block_size=8, target_layer_ids=[1, 4])))
    draft.config.final_logit_softcapping = draft_cap
    target = Target(model)
    prompt = mx.array(tokenizer.encode("the quick brown fox"))
    features = target.forward(prompt[None], target.make_cache(), draft.config.target_layer_ids).features
    ranking = rank_tokens(prompt.tolist(), target.vocab_size)
    logits = []
    for head in (None, subset_head(target, ranking, 48)):
        proposer = DraftProposer(draft, target, head=head)
        proposer.observe(features, prompt)
        logits.append(np.array(proposer.propose(mx.array([17]), 8)))
    full, sub = logits
    inside = np.zeros(target.vocab_size, dtype=bool)
    inside[ranking[:48]] = True
    np.testing.assert_allclose(sub[:, inside], full[:, inside], rtol=1e-5, atol=1e-4)
    assert np.all(np.isneginf(sub[:, ~inside]))
    assert np.abs(full).max() < 30.0


def test_subset_head_checks_its_ranking_and_size(target_dirs):
    target = Target(mlx_lm_load(str(target_dirs["qwen3"]))[0])
    with pytest.raises(DFlashError, match="needs a ranking beside the draft"):
        subset_head(target, None, 10)
    with pytest.raises(DFlashError, match="covers 5 ids but the target has"):
        subset_head(target, rank_tokens([], 5), 3)
    ranking = rank_tokens([], target.vocab_size)
    with pytest.raises(DFlashError, match="from 1 to the vocabulary size"):
        subset_head(target, ranking, target.vocab_size + 1)
    assert subset_head(target, ranking, 8) is subset_head(target, ranking, 8)  # sliced once


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("tree_budget", [None, 16])
def test_greedy_output_is_mlx_lm_greedy_output_and_drafts_stay_in_the_subset(target_dirs, draft_dir, family, tree_budget):
    model, tokenizer = mlx_lm_load(str(target_dirs[family]))
    draft = load_draft(str(draft_dir(family, block_size=8)))
    target = Target(model)
    ids = [i for p in chain.PROMPTS for i in tokenizer.encode(p)]
    draft.vocab_ranking = rank_tokens(ids, target.vocab_size)
    size = 64
    subset = set(draft.vocab_ranking[:size].tolist())
    proposer = DraftProposer(draft, target, head=subset_head(target, draft.vocab_ranking, size))
    logits = proposer.propose(mx.array([ids[0]]), 8)
    finite = np.isfinite(np.array(logits))
    assert all(set(np.flatnonzero(row).tolist()) == subset for row in finite)
    for prompt in chain.PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        want = chain.greedy_reference(model, prompt_ids, 40)
        got = generate(model, draft, tokenizer, prompt_ids, max_tokens=40, block_size=8,
                       tree_budget=tree_budget, draft_vocab=size)
        chain.assert_same_or_near_tie(model, prompt_ids, got.tokens, want)


class SubsetProposer(sampled.NoisyTargetProposer):
    """The target's own distribution through the sliced head over 10 of the 16
    ids (the target's likeliest among them), flattened by 0.8."""

    IDS = mx.array([0, 2, 3, 5, 6, 8, 9, 11, 12, 15])

    def row(self, seq):
        target = Target(self.model)
        logits = SubsetHead(target, self.IDS).logits(target.forward(mx.array(seq)[None], None, [0]).hidden[0, -1])
        return 0.8 * logits, mx.argmax(logits).item()


@pytest.mark.statistical
@pytest.mark.parametrize("name", ["topp0.9"])
def test_sampling_with_a_reduced_vocabulary_follows_the_targets_distribution(model, name):  # noqa: F811
    params = sampled.CONFIGS[name]
    tokens, accepted = sampled.sample(model, params, proposer=SubsetProposer, runs=500)
    for position, p in sampled.pvalues(tokens, sampled.exact_joint(model, params)).items():
        assert p > sampled.ALPHA, f"{name}: {position} deviates from the target (p = {p:.2e})"
    outside = np.setdiff1d(np.arange(sampled.V), np.array(SubsetProposer.IDS))
    assert np.isin(tokens[:, 1:], outside).any(), "tokens outside the subset must still be emitted"
    assert (accepted >= 1).mean() > 0.2, "drafts must often be accepted for this to bite"


def cli(*args):
    """(exit code, output) of the CLI run in-process."""
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


def test_draft_vocab_command_then_generate(tmp_path, target_dirs, draft_dir):
    draft = tmp_path / "draft"
    shutil.copytree(draft_dir("qwen3"), draft)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    target = target_dirs["qwen3"]
    code, out = cli("draft-vocab", "-m", target, "-d", draft, corpus)
    assert code == 0 and f"wrote {draft / RANKING_FILE}" in out, out
    ids = tokenize(target, corpus.read_text())
    ranking = read_ranking(draft)
    assert set(ranking[: len(set(ids))].tolist()) == set(ids)  # every id the corpus holds, ahead of the unseen
    assert ranking[0] == np.argmax(np.bincount(ids))
    code, out = cli("generate", "-m", target, "-d", draft, "-p", "the quick", "-n", "12",
                    "--no-chat-template", "--draft-vocab", "16")
    assert code == 0 and "tau" in out, out
    for args, message in (
        (["generate", "-m", target, "-d", draft, "-p", "x", "--draft-vocab", "100000"],
         "error: the drafting vocabulary must be from 1 to the vocabulary size"),
        (["generate", "-m", target, "-d", draft_dir("qwen3"), "-p", "x", "--draft-vocab", "8"],
         "error: a reduced drafting vocabulary needs a ranking beside the draft"),
        (["draft-vocab", "-m", target, "-d", draft, tmp_path / "missing"], "error: corpus path"),
    ):
        code, out = cli(*args)
        assert code == 1 and message in out and "Traceback" not in out, out


def tokenize(target, text):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(target).encode(text)
