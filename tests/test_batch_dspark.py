"""DSpark drafts in the batch decoder (``loop/batch.py``): each row drafts
what it would draft alone (one batched pass over the trained-width block, then
its own Markov walk with its own sampler), greedy rows give mlx-lm's greedy
output and their solo runs with rows joining and leaving, no cycle verifies
wider than gamma + 1, rollback stays exact per row at every combination of
acceptance lengths, and sampled rows follow their own target distributions."""

import itertools
import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from test_batch import assert_row_caches_equal, solo_caches
from test_dspark import GAMMA, greedy_reference, write_dspark_draft
from test_dspark_gemma4 import write_gemma4_dspark_draft
from test_sampling import PROMPT, V, WRONG_RULES, RuleSampler, build_target, exact_joint, pvalues

from dflash_mlx import Target, batch_generate, generate, load_draft
from dflash_mlx.loop import BatchDecoder, BlockSampler, SamplingParams
from dflash_mlx.loop.decoder import DSparkProposer, SpeculativeDecoder

FAMILIES = ["llama", "qwen3", "qwen3_5"]
PROMPTS = ["the quick brown fox", "hello", "write a short story about a cat who", "a b c d e f g h i j k"]
LIMITS = [20, 7, 13, 24]  # rows leave at different cycles


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, target_dirs):
    """family -> (mlx-lm model, tokenizer, its DSpark draft (gamma = GAMMA))."""
    out = {}
    for family in FAMILIES:
        model, tokenizer = mlx_lm_load(str(target_dirs[family]))
        path = tmp_path_factory.mktemp(f"batch-dspark-{family}")
        write_dspark_draft(path, model, json.loads((target_dirs[family] / "config.json").read_text()))
        out[family] = (model, tokenizer, load_draft(str(path)))
    return out


@pytest.mark.filterwarnings("ignore:block_size 12 is above")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [GAMMA + 1, 2 * GAMMA + 2])
def test_every_row_is_mlx_lms_greedy_output_and_its_solo_run(loaded, family, block_size):
    """Rows of different prompts join (the fourth when the first leaves) and
    leave; a fixed block of twice gamma + 1 (the widest allowed) runs at gamma + 1."""
    model, tokenizer, draft = loaded[family]
    results = batch_generate(model, draft, tokenizer, PROMPTS, max_tokens=LIMITS, block_size=block_size,
                             max_concurrency=3)
    for prompt, limit, result in zip(PROMPTS, LIMITS, results):
        ids = tokenizer.encode(prompt)
        want = greedy_reference(model, ids, limit)
        eos = tokenizer.eos_token_id
        assert result.tokens == (want[: want.index(eos)] if eos in want else want)
        solo = generate(model, draft, tokenizer, prompt, max_tokens=limit, block_size=block_size)
        assert result.tokens == solo.tokens
        assert max(result.block_sizes) == GAMMA + 1  # never wider than trained


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_gemma4_dspark_rows_are_mlx_lms_greedy_output(tmp_path, target_dirs, family):
    """A DSpark draft with Gemma 4's layer (``Gemma4DSparkModel``) batches too."""
    model, tokenizer = mlx_lm_load(str(target_dirs[family]))
    write_gemma4_dspark_draft(tmp_path, model, json.loads((target_dirs[family] / "config.json").read_text()))
    draft = load_draft(str(tmp_path))
    results = batch_generate(model, draft, tokenizer, PROMPTS[:3], max_tokens=LIMITS[:3], block_size=GAMMA + 1)
    for prompt, limit, result in zip(PROMPTS, LIMITS, results):
        ids = tokenizer.encode(prompt)
        want = greedy_reference(model, ids, limit)
        eos = tokenizer.eos_token_id
        assert result.tokens == (want[: want.index(eos)] if eos in want else want)
        assert max(result.block_sizes) == GAMMA + 1


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=7)])
def test_each_row_drafts_what_it_drafts_alone(loaded, params):
    """The batch's drafts and q for rows of different lengths equal a solo
    DSparkProposer's after the same prompt (the same keys at T > 0), at the
    full block and a narrower one (the first slots of the trained block)."""
    model, tokenizer, draft = loaded["qwen3"]
    target, layers = Target(model), draft.config.target_layer_ids
    prompts = [mx.array(tokenizer.encode(p)) for p in PROMPTS[:3]]
    for block_size in (GAMMA + 1, 3):
        batch = BatchDecoder(target, draft, block_size)
        rows = [batch.add(p, BlockSampler(replace(params)))[0] for p in prompts]
        ys = mx.array([row.pending for row in rows], dtype=mx.int32)
        for prompt, (drafted, q, finite) in zip(prompts, batch.drafter.propose(ys, block_size, rows)):
            solo = SpeculativeDecoder(target, DSparkProposer(draft, target), layers, block_size,
                                      sampler=BlockSampler(replace(params)))
            solo.prefill(prompt)
            assert drafted.tolist() == solo.drafted.tolist() and drafted.size == block_size - 1
            assert finite.item()
            if params.temperature:
                assert mx.allclose(q, solo.draft_logprobs, atol=1e-3).item()
            else:
                assert q is None and solo.draft_logprobs is None


class SteeringHead:
    """The target's head plus ``push`` [B, gamma, V], set before each cycle:
    the DSpark draft's base logits U_k pushed towards chosen tokens, so its
    Markov walk proposes them (handed to the batch as its drafting head)."""

    def __init__(self, target):
        self.target, self.push = target, None

    def logits(self, hidden):
        return self.target.logits(hidden) + self.push


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_rollback_is_exact_per_row_at_every_combination_of_acceptance_lengths(loaded, family):
    """Two DSpark rows, pushed towards their greedy continuations and broken
    at slot a (a = gamma: not broken), accept exactly (a_0, a_1) for every pair
    in 0..gamma; each row's tokens stay mlx-lm's greedy output, its target
    caches hold its committed tokens, its draft context holds every committed position."""
    model, tokenizer, draft = loaded[family]
    target = Target(model)
    head = SteeringHead(target)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    plans = list(itertools.product(range(GAMMA + 1), repeat=2))
    length = sum(max(plan) for plan in plans) + 2 * len(plans) + GAMMA + 2
    continuations = [p + greedy_reference(model, p, length) for p in prompts]
    decoder = BatchDecoder(target, draft, GAMMA + 1, head=head)
    rows = [decoder.add(mx.array(p), BlockSampler(SamplingParams()), tag=i)[0] for i, p in enumerate(prompts)]
    for plan in plans:
        pushes = []
        for row, a in zip(rows, plan):
            start = len(row.tokens) + 1  # the index of d_1
            tokens = list(continuations[row.tag][start : start + GAMMA])
            if a < GAMMA:
                tokens[a] = (tokens[a] + 1) % target.vocab_size
            pushes.append((mx.arange(target.vocab_size)[None] == mx.array(tokens)[:, None]) * 1000.0)
        head.push = mx.stack(pushes)
        for row, a, cycle in zip(rows, plan, decoder.cycle()):
            assert cycle.accepted == a
            assert row.tokens + [row.pending] == continuations[row.tag][: len(row.tokens) + 1]
        for r, row in enumerate(rows):
            assert_row_caches_equal([c.extract(r) for c in decoder.cache], solo_caches(target, row.tokens))
        for c in decoder.drafter.proposer.cache:
            assert c.lengths == [len(row.tokens) for row in rows]


# ---------------------------------------------------------------- sampling

RUNS = 200
ROWS = {"a": SamplingParams(temperature=1.0, top_k=3), "b": SamplingParams(temperature=0.7, top_k=4)}
ALPHA = 1e-3 / (2 * 3)  # Bonferroni over both rows' three chi-square tests
POSITIONS = 3  # x1 from the prefill, x2 and x3 from the walk
STEER = 2.0  # weight of the target's logits added to the draft's base logits


def target_path(model, memo, history, n):
    """The target's logits [n, V] along its greedy path after ``history`` (memoized)."""
    key = tuple(history)
    if key not in memo:
        seq, rows = list(history), []
        for _ in range(n):
            rows.append(model(mx.array(seq)[None])[0, -1])
            seq.append(mx.argmax(rows[-1]).item())
        memo[key] = mx.stack(rows)
    return memo[key]


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """test_sampling's tiny hybrid target and a DSpark draft for it (gamma = 3),
    its Markov term about as large as the logits, so that the walk's path moves q."""
    model, config = build_target("qwen3_5", vocab_size=V, seed=3, num_hidden_layers=2)
    inner = model.language_model.model
    inner.norm.weight = inner.norm.weight * 0.15
    path = tmp_path_factory.mktemp("batch-dspark-sampling")
    write_dspark_draft(path, model, config, gamma=3, rank=4, markov_std=1.5, target_layer_ids=[0], seed=5)
    return model, load_draft(str(path))


def sample_rows(model, draft, make_sampler=BlockSampler):
    """({tag: tokens [RUNS, POSITIONS]}, accepted drafts per row-cycle): every
    run a batch of both rows (row "a" with ``make_sampler``), every draft from
    the batch's DSpark pass and the row's own walk, its base logits steered
    towards the target's so that blocks are often accepted deep."""
    target, memo = Target(model), {}
    head = SteeringHead(target)
    tokens, accepted = {tag: [] for tag in ROWS}, []
    for seed in range(RUNS):
        decoder = BatchDecoder(target, draft, 8, head=head)  # runs at gamma + 1 = 4
        out = {}
        for tag, params in ROWS.items():
            sampler = (make_sampler if tag == "a" else BlockSampler)(replace(params, seed=2 * seed + (tag == "b")))
            out[tag] = [decoder.add(mx.array(PROMPT), sampler, tag=tag)[1]]
        while min(len(t) for t in out.values()) < POSITIONS:
            head.push = STEER * mx.stack([target_path(model, memo, row.tokens + [row.pending], 3)
                                          for row in decoder.rows])
            for cycle in decoder.cycle():
                out[cycle.row.tag] += cycle.tokens
                accepted.append(cycle.accepted)
            assert decoder.block_size == 4
        for tag in ROWS:
            tokens[tag].append(out[tag][:POSITIONS])
    return {tag: np.array(t) for tag, t in tokens.items()}, np.array(accepted)


@pytest.mark.statistical
def test_each_sampled_row_follows_its_own_targets_distribution(sampling_pair):
    model, draft = sampling_pair
    tokens, accepted = sample_rows(model, draft)
    for tag, params in ROWS.items():
        for position, p in pvalues(tokens[tag], exact_joint(model, params, depth=POSITIONS)).items():
            assert p > ALPHA, f"row {tag}: {position} deviates from the target (p = {p:.2e})"
    assert (accepted >= 1).mean() > 0.4, "drafts must often be accepted for this to bite"


@pytest.mark.statistical
def test_a_wrong_rule_in_one_row_is_caught(sampling_pair):
    """The negative control: row "a" verifies with a wrong rule; it fails the
    same test, while row "b" beside it still passes."""
    model, draft = sampling_pair
    rule = WRONG_RULES["residual p, not max(p - q, 0)"]
    tokens, _ = sample_rows(model, draft, lambda params: RuleSampler(params, rule))
    wrong = pvalues(tokens["a"], exact_joint(model, ROWS["a"], depth=POSITIONS))
    assert min(wrong.values()) < 1e-6
    assert min(pvalues(tokens["b"], exact_joint(model, ROWS["b"], depth=POSITIONS)).values()) > ALPHA
