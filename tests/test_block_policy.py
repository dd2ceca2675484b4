"""The block size per cycle: the adaptive policy's choices from a fixed
synthetic cost curve (no timing enters), the decoder's plain target step at
b = 1, and losslessness whatever the blocks: greedy output equals mlx-lm's for
auto and every fixed block on several families, and auto at temperature > 0
passes the same distribution check as the chain."""

import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from checkpoints import build_target
from dflash_mlx import DFlashError, Target, generate, load_draft, stream_generate
from dflash_mlx.loop.block_policy import (PRIOR_ACCEPTANCE, PRIOR_MARGIN, PROBE_BACKOFF_BUDGET, PROBE_BUDGET, PROBE_EVERY,
                                          PROBE_FIRST_BUDGET, PROBE_WARMUP, UNREACHED_RATE, AdaptiveBlock,
                                          FixedBlock)
from dflash_mlx.loop.cost_curve import CostCurve
from dflash_mlx.loop.decoder import SpeculativeDecoder
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams, warp
import test_sampling as sampled
from test_loop import assert_same_or_near_tie, greedy_reference

# a verify pass costs 1 + b/10, a draft pass 0.3 + b/20 (arbitrary units)
CURVE = CostCurve((1, 2, 4, 8, 16), (1.1, 1.2, 1.4, 1.8, 2.6), (0.0, 0.4, 0.5, 0.7, 1.1))
FLAT = CostCurve((1, 16), (1.0, 1.0), (0.0, 1e-9))  # speculation is free: the largest block wins
STEEP = CostCurve((1, 16), (1.0, 16.0), (0.0, 16.0))  # a block costs as much as its plain steps


class Linear:
    """cycle_seconds(b) = a + s * (b - 1) (+ d for a draft pass)."""

    def __init__(self, a, s, d):
        self.a, self.s, self.d = a, s, d

    def cycle_seconds(self, b, context=None):
        return self.a + self.s * (b - 1) + (self.d if b > 1 else 0.0)

    def draft(self, b, context=None):
        return self.d


def test_fixed_block_always_answers_its_block():
    policy = FixedBlock(5)
    policy.update(5, 0)
    assert [policy.choose() for _ in range(3)] == [5, 5, 5]


def test_expected_tokens_follow_the_per_position_acceptance():
    policy = AdaptiveBlock(FLAT, 4, prior=0.5)
    assert [policy.expected_tokens(b) for b in (1, 2, 3, 4)] == [1.0, 1.5, 1.75, 1.875]
    policy.acceptance = [1.0, 0.5, 0.0]
    assert [policy.expected_tokens(b) for b in (1, 2, 3, 4)] == [1.0, 2.0, 2.5, 2.5]


def test_the_choice_maximises_expected_tokens_per_second():
    assert AdaptiveBlock(FLAT, 16).choose() == 16
    assert AdaptiveBlock(STEEP, 16).choose() == 1
    policy = AdaptiveBlock(Linear(1.0, 0.05, 0.1), 16, prior=0.6)
    rates = {b: policy.expected_tokens(b) / (1.0 + 0.05 * (b - 1) + (0.1 if b > 1 else 0)) for b in range(1, 17)}
    assert rates[5] > (1 + PRIOR_MARGIN) * rates[1]  # on the prior, a promise past the margin
    assert policy.choose() == max(rates, key=rates.get) == 5
    assert AdaptiveBlock(Linear(1.0, 0.1, 0.3), 16, prior=0.95).choose() == 16
    assert AdaptiveBlock(FLAT, 8).choose() == 8  # never past max_block


def test_outcomes_update_only_the_positions_a_cycle_reached():
    policy = AdaptiveBlock(FLAT, 6, prior=0.5, rate=0.5)
    policy.update(4, 1)  # position 1 accepted, 2 rejected, 3 never judged
    assert policy.acceptance == [0.75, 0.25, 0.5, 0.5, 0.5]
    policy.update(3, 2)  # every drafted position accepted: no rejection to count
    assert policy.acceptance == [0.875, 0.625, 0.5, 0.5, 0.5]


def test_positions_past_a_block_accepted_whole_move_back_toward_the_prior():
    policy = AdaptiveBlock(FLAT, 6, prior=0.5, rate=0.5)
    policy.acceptance = [1.0, 1.0, 0.0, 0.0, 1.0]
    policy.update(3, 2)  # both drafts accepted: positions 3 to 5 not reached
    assert policy.acceptance == [1.0, 1.0, UNREACHED_RATE * 0.5, UNREACHED_RATE * 0.5, 1.0 - UNREACHED_RATE * 0.5]
    past_a_rejection = list(policy.acceptance)
    policy.update(3, 0)  # rejected at position 1: position 2 and those past it do not move
    assert policy.acceptance[1:] == past_a_rejection[1:] and policy.acceptance[0] == 0.5
    before = list(policy.acceptance)
    policy.update(1, 0)  # a plain step drafts nothing: no outcome at all
    assert policy.acceptance == before


def test_a_block_cut_short_by_failing_cycles_grows_again_once_it_is_accepted_whole():
    """Cycles rejected at the third draft pull c_3 down and the block to 3
    or 4; when the text turns predictable every block of 3 is accepted whole and
    never reaches position 3, so only its drift back toward the prior lets
    the policy try a longer block, which then finds the drafts right."""
    policy = AdaptiveBlock(CURVE, 16)
    for _ in range(12):
        b = policy.choose()
        policy.update(b, min(2, b - 1))
    assert policy.choose() <= 4
    blocks = []
    for _ in range(40):
        blocks.append(policy.choose())
        policy.update(blocks[-1], blocks[-1] - 1)
    assert blocks == sorted(blocks) and blocks[-1] == 16


def test_on_the_prior_alone_speculation_must_promise_a_margin():
    """Where the prior promises speculation less than the margin (40% over
    plain steps, the margin being 50%), the policy starts plain; a measured
    outcome at the same acceptance makes the same promise enough. A larger
    promise (60%) speculates at once."""
    assert PRIOR_MARGIN == 0.5
    a_little = AdaptiveBlock(CostCurve((1, 2), (1.0, 1.0), (0.0, (1 + PRIOR_ACCEPTANCE) / 1.4 - 1.0)), 2)
    assert a_little.choose() == 1
    a_little.probed(2, [PRIOR_ACCEPTANCE])  # an outcome that leaves c_1 where the prior put it
    assert a_little.acceptance == [PRIOR_ACCEPTANCE] and a_little.choose() == 2
    assert AdaptiveBlock(CostCurve((1, 2), (1.0, 1.0), (0.0, (1 + PRIOR_ACCEPTANCE) / 1.6 - 1.0)), 2).choose() == 2


def test_rejections_turn_speculation_off_and_probes_bring_it_back():
    policy = AdaptiveBlock(Linear(1.0, 0.1, 0.3), 16)
    chosen, probes = [], []

    def cycle(draft_right):
        b = policy.choose()
        chosen.append(b)
        policy.update(b, b - 1 if draft_right else 0)
        probe = policy.probe() if b == 1 else 0
        if probe:  # judged against the plain steps' tokens, never verified
            probes.append((len(chosen) - 1, probe))
            policy.probed(probe, [1.0] * (probe - 1) if draft_right else [0.0])

    for _ in range(40):  # the draft is always wrong
        cycle(False)
    first_plain = chosen.index(1)
    assert all(b > 1 for b in chosen[:first_plain])
    probes = sorted(probes + [(i, b) for i, b in enumerate(chosen) if i > first_plain and b > 1])  # + verified
    assert probes and all(b < chosen[0] for _, b in probes)  # the first position is known bad
    assert all(j - i >= PROBE_EVERY for (i, _), (j, _) in zip(probes, probes[1:]))
    turned = len(chosen)
    for _ in range(100):  # now the draft is always right: the probes find out
        cycle(True)
    recovery = chosen[turned:]
    back = max(i for i, b in enumerate(recovery) if b == 1) + 1  # speculating from here on
    assert back <= 3 * PROBE_EVERY  # a few probes find out
    speculating = recovery[back:]
    assert all(a <= b for a, b in zip(speculating, speculating[1:]))  # grows as positions prove good
    assert chosen[-10:] == [16] * 10


def test_a_probe_is_due_only_while_plain_steps_win():
    policy = AdaptiveBlock(FLAT, 4)
    assert policy.choose() == 4 and policy.probe() == 0
    # the curve alone says "plain", the drafts may say otherwise: a probe PROBE_EVERY plain
    # steps in where its draft pass is cheap; where it is dear, once its loss is at most
    # PROBE_FIRST_BUDGET of the plain steps before it
    cheap = CostCurve((1, 16), (1.0, 16.0), (0.0, 0.3))
    for curve, first in ((cheap, PROBE_EVERY), (STEEP, math.ceil(STEEP.draft(2) / PROBE_FIRST_BUDGET))):
        policy = AdaptiveBlock(curve, 4)
        due = [policy.choose() == 1 and policy.probe() for _ in range(3 * first)]
        assert due[: first - 1] == [0] * (first - 1) and due[first - 1] > 1
        assert all(b in (0, 2, 3, 4) for b in due) and due.count(0) > len(due) / 2
    assert first == 267  # STEEP's draft pass costs 16 plain steps


def _probe_steps(policy, n):
    """The plain steps (of ``n``) beside which a probe was taken, drafted or
    verified, every one finding the first position wrong."""
    taken = []
    for i in range(n):
        b = policy.choose(context=i)  # one token a plain step
        probe = policy.probe() if b == 1 else b
        if probe > 1:
            taken.append(i)
            policy.update(b, 0) if b > 1 else policy.probed(probe, [0.0])
    return taken


def test_probes_that_find_nothing_back_off_to_the_budgets_spacing():
    """A pair whose curve says "plain" from the start: the first probe comes
    ``PROBE_EVERY`` plain steps in (or, dearer, once its loss is at most
    ``PROBE_FIRST_BUDGET`` of the steps before it), and the next ones as far
    apart while fewer than ``PROBE_WARMUP`` tokens were generated (a draft's
    first blocks are often wrong); after k that found nothing past it the next
    waits ``PROBE_EVERY`` x 2^k, and at least long enough for its loss to be
    ``PROBE_BACKOFF_BUDGET`` of the steps between, never longer than the
    spacing at which a probe costs ``PROBE_BUDGET`` of the plain steps' time."""
    for draft_s in (0.3, 1.0):  # a draft pass costs 0.3 or 1 plain step
        taken = _probe_steps(AdaptiveBlock(CostCurve((1, 16), (1.0, 16.0), (0.0, draft_s)), 4), 600)
        budget, backoff = math.ceil(draft_s / PROBE_BUDGET), math.ceil(draft_s / PROBE_BACKOFF_BUDGET)
        first = max(PROBE_EVERY, math.ceil(draft_s / PROBE_FIRST_BUDGET))
        warm = [i for i in taken if i < PROBE_WARMUP]
        assert warm == list(range(first - 1, PROBE_WARMUP, first))
        counted = taken[len(warm):]
        assert counted[0] == (warm[-1] if warm else -1) + first
        gaps = [j - i for i, j in zip(counted, counted[1:])]
        doubling = [min(max(PROBE_EVERY * 2**k, backoff), budget) for k in (1, 2, 3)]
        assert gaps[:3] == doubling and set(gaps[3:]) == {budget}
    assert doubling == [34, 34, 64] and first == 17  # a dear probe: the budgets hold the first ones apart


def _speculate_until_plain(policy, accepted):
    """Speculate on the policy's own choice, ``accepted`` drafts the first
    cycle, none after it, until it turns plain."""
    b = policy.choose()
    assert b > 1
    policy.update(b, accepted)
    while (b := policy.choose()) > 1:
        policy.update(b, 0)


@pytest.mark.parametrize("paid", [True, False])
def test_only_a_cycle_that_paid_brings_the_probes_close_again(paid):
    """Probes that find nothing back off (2x, 4x, ... ``PROBE_EVERY``). A
    probe's right drafts start speculation: when its first cycle pays for
    itself (2 tokens for 2 plain steps' time) the probes after it come close
    again; when it fails, they keep backing off from where they were, so that
    drafts that keep failing cannot start a probe every ``PROBE_EVERY`` steps."""
    policy = AdaptiveBlock(Linear(1.0, 0.1, 1.0), 16, probe_warmup=0)  # a cycle at 16: 3.5 plain steps; probes drafted
    taken = _probe_steps(policy, 15 * PROBE_EVERY)  # the prior says plain
    assert len(taken) == policy.failed_probes == 3
    policy.probed(16, [1.0] * 15)  # the drafts turned right
    _speculate_until_plain(policy, 3 if paid else 0)  # 4 tokens for 3.5 plain steps' time: paid
    assert policy.failed_probes == (0 if paid else 4)
    gap = _probe_steps(policy, 400)[0] + 2  # plain steps to the next probe (one came before; this one included)
    assert gap == PROBE_EVERY if paid else gap > 2 * PROBE_EVERY  # unpaid: the budget's spacing for the cheaper probe


def test_a_probe_is_verified_only_once_speculation_ran_and_where_that_costs_less():
    curve = CostCurve((1, 16), (1.0, 1.0), (0.0, 2.0))  # verifying is free, drafting dear
    policy = AdaptiveBlock(curve, 4)
    first = math.ceil(curve.draft(4) / PROBE_FIRST_BUDGET)  # a draft pass of 2 plain steps: 34 steps in
    due = [policy.choose() == 1 and policy.probe() for _ in range(first)]
    assert not any(due[:-1]) and due[-1] > 1  # only drafted
    policy.acceptance, policy.learned = [1.0] * 3, True  # as if measured: no prior's margin
    assert policy.choose() == 4  # speculating
    for _ in range(3):
        policy.update(4, 0)
    probe = policy.best(low=2)
    gap = policy.probe_interval(probe)
    chosen = [policy.choose() for _ in range(gap)]
    assert gap >= PROBE_EVERY and chosen == [1] * (gap - 1) + [probe] and policy.verifying_probe  # verified
    assert policy.probe() == 0  # nothing drafted beside a plain step
    assert policy.verified_probe_loss(probe) < policy.drafted_probe_loss(probe)


def test_outcomes_of_probes_update_the_positions_they_reached():
    policy = AdaptiveBlock(FLAT, 6, prior=0.5, rate=0.5)
    policy.probed(3, [1.0, 0.5])
    assert policy.acceptance == [0.75, 0.5, 0.5, 0.5, 0.5]


def test_the_choices_are_deterministic_given_curve_and_outcomes():
    outcomes = np.random.default_rng(0).integers(0, 16, size=200)

    def run():
        policy, out = AdaptiveBlock(CURVE, 16), []
        for a in outcomes:
            b = policy.choose()
            out.append(b)
            policy.update(b, min(int(a), b - 1))
        return out

    first = run()
    assert first == run() and len(set(first)) > 2


class ScriptedPolicy:
    """Answers a fixed sequence of blocks and records the outcomes."""

    def __init__(self, blocks):
        self.blocks = list(blocks)
        self.outcomes = []

    def choose(self, context=0, left=None):
        return self.blocks.pop(0)

    def update(self, block_size, accepted):
        self.outcomes.append((block_size, accepted))


class CountingOracle:
    """Proposes the target's greedy continuation; records each block asked for."""

    def __init__(self, prompt_len, continuation, vocab_size):
        self.position, self.prompt_len = 0, prompt_len
        self.continuation, self.vocab_size = continuation, vocab_size
        self.asked = []

    def observe(self, features, tokens):
        self.position += tokens.size

    def propose(self, y, block_size):
        self.asked.append(block_size)
        start = self.position - self.prompt_len + 1
        tokens = self.continuation[start : start + block_size - 1]
        return (mx.arange(self.vocab_size)[None] == mx.array(tokens)[:, None]).astype(mx.float32)


@pytest.fixture(scope="module")
def qwen3_5(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    return model, tokenizer, load_draft(str(draft_dir("qwen3_5", block_size=16)))


def test_a_block_of_one_is_a_plain_target_step_with_no_draft_pass(qwen3_5):
    """Blocks 1 and larger interleave on a hybrid target; b = 1 commits exactly
    the target's one token and never calls the proposer."""
    model, tokenizer, _ = qwen3_5
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    continuation = greedy_reference(model, prompt, 60)
    oracle = CountingOracle(len(prompt), continuation, target.vocab_size)
    blocks = [1, 1, 4, 1, 2, 8, 1, 1, 3, 1]
    policy = ScriptedPolicy(blocks + [1])
    decoder = SpeculativeDecoder(target, oracle, [0], policy, prefill_step_size=3)
    out = [decoder.prefill(mx.array(prompt))]
    for b in blocks:
        assert decoder.block_size == b
        cycle = decoder.cycle()
        assert len(cycle.tokens) == b and cycle.accepted == b - 1  # the oracle is always right
        out += cycle.tokens
    assert out == continuation[: len(out)]
    assert oracle.asked == [b for b in blocks if b > 1]
    assert policy.outcomes == [(b, b - 1) for b in blocks]


class RecordingOracle(CountingOracle):
    """A CountingOracle that also records every id it is shown, batch by batch."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen, self.batches = [], []

    def observe(self, features, tokens):
        super().observe(features, tokens)
        self.seen += tokens.tolist()
        self.batches.append(tokens.size)


def test_plain_steps_run_one_ahead_and_the_caches_stay_in_step(qwen3_5):
    """Each plain step is queued before the cycle that emits its input returns
    (one step in flight behind the host, as mlx-lm decodes), yet whenever a
    cycle returns the target cache holds exactly ``tokens``; the prefill queues
    the first step (the first token is fed when it returns). The proposer gets
    the plain steps' features in one batch when it next drafts, and the rest on
    ``close()``."""
    model, tokenizer, _ = qwen3_5
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    continuation = greedy_reference(model, prompt, 40)
    oracle = RecordingOracle(len(prompt), continuation, target.vocab_size)
    blocks = [1, 1, 1, 4, 1, 1, 2, 1, 1]
    decoder = SpeculativeDecoder(target, oracle, [0], ScriptedPolicy(blocks + [1]))
    attention = next(c for c in decoder.cache if c.is_trimmable())
    out = [decoder.prefill(mx.array(prompt))]
    assert decoder.tokens == prompt + out and attention.offset == len(prompt) + 1 and decoder.queued is not None
    for b in blocks:
        out += decoder.cycle().tokens
        fed = prompt + out if decoder.block_size == 1 else prompt + out[:-1]  # the last one too while plain
        assert decoder.tokens == fed and attention.offset == len(fed)
    assert out == continuation[: len(out)]
    assert oracle.seen == decoder.tokens[: len(oracle.seen)] and len(oracle.seen) < len(decoder.tokens)
    decoder.close()
    assert oracle.seen == decoder.tokens
    assert oracle.batches == [len(prompt) - 1, 1, 3, 4, 2, 2, 3]  # prompt (its last token alone), 3 plain, block 4, 2 plain, block 2, 3 plain


class ProbingPolicy:
    """Plain steps only, with a probe of block ``b`` due after the ``at``-th choice."""

    def __init__(self, at, b):
        self.at, self.b, self.asked, self.outcomes = at, b, 0, []

    def choose(self, context=0, left=None):
        self.asked += 1
        return 1

    def probe(self):
        return self.b if self.asked == self.at else 0

    def probed(self, block_size, hits):
        self.outcomes.append(hits)

    def update(self, block_size, accepted):
        pass


class PartlyRightOracle(CountingOracle):
    """Proposes the greedy continuation at the first ``right`` positions, then wrong tokens."""

    def __init__(self, right, *args):
        super().__init__(*args)
        self.right = right

    def propose(self, y, block_size):
        self.asked.append(block_size)
        start = self.position - self.prompt_len + 1
        tokens = self.continuation[start : start + block_size - 1]
        tokens = [t if i < self.right else (t + 1) % self.vocab_size for i, t in enumerate(tokens)]
        return (mx.arange(self.vocab_size)[None] == mx.array(tokens)[:, None]).astype(mx.float32)


@pytest.mark.parametrize("right", [0, 1, 2, 3])
def test_a_probe_is_judged_against_the_targets_own_tokens_not_verified(qwen3_5, right):
    """A probe of block 4 drafts 3 tokens beside a plain step; the policy learns
    exactly where they part from the target's next tokens (each acceptance
    length 0..3), while every cycle stays a plain step with the target's token."""
    model, tokenizer, _ = qwen3_5
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    continuation = greedy_reference(model, prompt, 12)
    oracle = PartlyRightOracle(right, len(prompt), continuation, target.vocab_size)
    policy = ProbingPolicy(at=3, b=4)
    decoder = SpeculativeDecoder(target, oracle, [0], policy)
    out = [decoder.prefill(mx.array(prompt))]
    while len(out) < 12:
        cycle = decoder.cycle()
        assert len(cycle.tokens) == 1 and cycle.accepted == 0
        out += cycle.tokens
    assert out == continuation
    assert oracle.asked == [4]  # one draft pass, for the probe
    assert policy.outcomes == [[1.0] * right + ([0.0] if right < 3 else [])]


def test_a_sampled_probe_learns_the_rejection_rules_acceptance(qwen3_5):
    """At T > 0 the probe's first position is judged by min(1, p/q) of the
    target's warped distribution after the token it was drafted from."""
    model, tokenizer, _ = qwen3_5
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    params = SamplingParams(temperature=1.0, seed=7)
    oracle = CountingOracle(len(prompt), [0] * 40, target.vocab_size)  # drafts token 0 everywhere
    policy = ProbingPolicy(at=2, b=4)
    decoder = SpeculativeDecoder(target, oracle, [0], policy, sampler=BlockSampler(params))
    out = [decoder.prefill(mx.array(prompt))]
    while len(out) < 8:
        out += decoder.cycle().tokens
    (hits,) = policy.outcomes
    before = prompt + out[:2]  # the probe was drafted after the second token
    p = np.exp(np.array(warp(model(mx.array(before)[None])[0, -1:], params), dtype=np.float64))[0, 0]
    q = np.exp(np.array(warp(mx.eye(target.vocab_size)[:1], params), dtype=np.float64))[0, 0]
    assert hits[0] == pytest.approx(min(1.0, p / q), rel=1e-4)
    matched = next((i for i, t in enumerate(out[2:5]) if t != 0), 3)
    assert len(hits) == min(matched + 1, 3)  # as far as the drafts match the tokens drawn


def test_a_plain_step_samples_from_the_target_when_sampling(qwen3_5):
    model, tokenizer, _ = qwen3_5
    target = Target(model)
    prompt = mx.array(tokenizer.encode("hello world"))
    sampler = BlockSampler(SamplingParams(temperature=1.0, seed=3))
    decoder = SpeculativeDecoder(target, CountingOracle(0, [], target.vocab_size), [0],
                                 ScriptedPolicy([1] * 9), sampler=sampler)
    decoder.prefill(prompt)
    tokens = [t for _ in range(8) for t in decoder.cycle().tokens]
    assert len(tokens) == 8 and len(set(tokens)) > 1


FAMILIES = ["llama", "qwen3_5", "qwen3_moe", "gpt_oss"]
PROMPTS = ["the quick brown fox", "write a short story about a cat who"]


def capped(res, block_size: int, max_tokens: int) -> list[int]:
    """Each cycle's block when every cycle asks for ``block_size``: that, or
    the tokens left to generate before the cycle when fewer."""
    left = [max_tokens - 1 - sum(res.acceptance_lengths[:i]) for i in range(len(res.block_sizes))]
    return [min(block_size, n) for n in left]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_same_for_auto_and_every_fixed_block(target_dirs, draft_dir, family):
    model, tokenizer = mlx_lm_load(str(target_dirs[family]))
    draft = load_draft(str(draft_dir(family, block_size=16)))
    blocks_seen = set()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        want = greedy_reference(model, ids, 48)
        if tokenizer.eos_token_id in want:
            want = want[: want.index(tokenizer.eos_token_id)]
        for block_size in ["auto", 2, 4, 8, 16]:
            res = generate(model, draft, tokenizer, ids, max_tokens=48, block_size=block_size,
                           cost_curve=CURVE)
            assert_same_or_near_tie(model, ids, res.tokens, want)
            if block_size == "auto":
                blocks_seen |= set(res.block_sizes)
            else:
                assert res.block_sizes == capped(res, block_size, 48) and block_size in res.block_sizes
    assert 1 in blocks_seen and len(blocks_seen) > 1, "auto never switched blocks: proves little"


def test_responses_report_the_block_of_each_cycle(qwen3_5):
    model, tokenizer, draft = qwen3_5
    responses = list(stream_generate(model, draft, tokenizer, "hello", max_tokens=30, cost_curve=CURVE))
    assert responses[0].block_size == 0  # the prefill token
    assert all(1 <= r.block_size <= 16 for r in responses[1:])
    assert all(r.accepted < r.block_size for r in responses[1:])
    res = generate(model, draft, tokenizer, "hello", max_tokens=30, cost_curve=CURVE)
    assert res.block_sizes == [r.block_size for r in responses[1:]]
    assert res.tokens == [t for r in responses for t in r.tokens]


def test_auto_is_the_default_and_reads_the_cached_curve(qwen3_5, tmp_path, monkeypatch):
    """Without a curve the pair's is taken from the cache (measured there once)."""
    from dflash_mlx.loop import cost_curve as cc

    model, tokenizer, draft = qwen3_5
    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path))
    target = Target(model)
    key = cc.cache_key(target, draft)
    cc.write_cached(cc.cache_path(key), key, FLAT)  # speculation is free: the trained block every cycle
    res = generate(target, draft, tokenizer, "hello", max_tokens=40)
    assert res.block_sizes == capped(res, draft.config.block_size, 40)
    assert res.tokens == greedy_reference(model, tokenizer.encode("hello"), 40)
    cc.write_cached(cc.cache_path(key), key, STEEP)  # a block costs its plain steps: plain steps only
    assert generate(target, draft, tokenizer, "hello", max_tokens=12).block_sizes == [1] * 11


def test_seeded_sampling_with_auto_reproduces(qwen3_5):
    model, tokenizer, draft = qwen3_5
    runs = [generate(model, draft, tokenizer, "hello", max_tokens=24, temperature=1.0, seed=s,
                     cost_curve=CURVE) for s in (5, 5, 6)]
    assert runs[0].tokens == runs[1].tokens and runs[0].block_sizes == runs[1].block_sizes
    assert runs[0].tokens != runs[2].tokens


@pytest.mark.parametrize("value, message", [
    ("big", "block_size must be an integer or 'auto', got 'big'"),
    ("Auto", "block_size must be an integer or 'auto'"),
    (1, "block_size must be at least 2"),
])
def test_block_size_takes_auto_or_an_integer(qwen3_5, value, message):
    model, tokenizer, draft = qwen3_5
    with pytest.raises(DFlashError, match=message):
        next(stream_generate(model, draft, tokenizer, "hello", block_size=value))


RUNS = 1200
ALPHA = 1e-3 / 3  # three chi-square tests; the false-failure rate stays <= 1e-3


@pytest.mark.parametrize("policy_name", ["auto", "plain"])
def test_auto_at_temperature_one_follows_the_targets_distribution(policy_name):
    """The chain's distribution check (as in tests/test_sampling.py) with the
    block chosen per cycle by one adaptive policy carried across all runs, so
    runs start from different blocks, 1 included; and with plain steps only."""
    model, _ = build_target("qwen3_5", vocab_size=sampled.V, seed=3)
    inner = model.language_model.model
    inner.norm.weight = inner.norm.weight * 0.25
    target, memo = Target(model), {}
    params = SamplingParams(temperature=1.0)
    policy = AdaptiveBlock(Linear(1.0, 0.3, 0.6), 4, probe_every=2) if policy_name == "auto" else FixedBlock(1)
    tokens, blocks = [], []
    for seed in range(RUNS):
        decoder = SpeculativeDecoder(target, sampled.NoisyTargetProposer(model, params, memo), [0], policy,
                                     sampler=BlockSampler(replace(params, seed=seed)))
        out = [decoder.prefill(mx.array(sampled.PROMPT))]
        while len(out) < sampled.POSITIONS:
            blocks.append(decoder.block_size)
            out += decoder.cycle().tokens
        tokens.append(out[:sampled.POSITIONS])
    counts = np.bincount(blocks, minlength=5)
    if policy_name == "auto":
        assert counts[1] > 100 and counts[2:].sum() > 100, f"blocks used {counts}: too one-sided to bite"
    tokens, joint = np.array(tokens), sampled.exact_joint(model, params)
    marginal = lambda *keep: joint.sum(axis=tuple(j for j in range(sampled.POSITIONS) if j not in keep))  # noqa: E731
    for cols in ([0, 1], [1, 2], [3]):
        p = sampled.chi2_pvalue(tokens[:, cols], marginal(*cols))
        assert p > ALPHA, f"x{cols}: p = {p:.2e}"


def test_bench_runs_an_auto_arm_beside_fixed_blocks(target_dirs, draft_dir, tmp_path, monkeypatch):
    """The auto arm reads the pair's cached curve, stays identical to the
    baseline, and its report carries the blocks of every cycle."""
    from rich.console import Console

    from dflash_mlx.loop import cost_curve as cc
    from dflash_mlx.bench import report, runs
    from dflash_mlx.bench.command import parse_block_sizes
    from dflash_mlx.bench.render import render
    from dflash_mlx.bench.schedule import Arm

    assert parse_block_sizes(["auto,16", "8", "auto"]) == ["auto", 16, 8]
    with pytest.raises(DFlashError, match="'x' is not an integer or 'auto'"):
        parse_block_sizes(["auto,x"])
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    draft = load_draft(str(draft_dir("qwen3", block_size=4)))
    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path))
    key = cc.cache_key(Target(model), draft)
    cc.write_cached(cc.cache_path(key), key, CostCurve((1, 2, 4), (1.0, 1.2, 1.6), (0.0, 0.5, 0.7)))
    prompts = [{"prompt": p, "category": "c", "id": str(i)} for i, p in enumerate(PROMPTS)]
    result = runs.run_bench(model, draft, tokenizer, prompts, arms=[Arm("auto"), Arm(4)], max_tokens=24,
                            chat_template=False, warmup_tokens=0)
    config = {"model": "t", "draft": "d", "max_tokens": 24, "block_sizes": ["auto", 4], "repeat": 1,
              "temperature": 0.0, "dtype": "checkpoint", "chat_template": False, "prompts": "test"}
    made = report.make_report(result, config, report.machine_info())
    report.validate_report(made)
    auto = made["summary"]["dflash"]["auto"]
    assert auto["identical"] == auto["compared"] == 2
    blocks = [b for r in made["runs"] if r["block_size"] == "auto" for b in r["blocks"]]
    assert auto["block_histogram"] == {str(b): blocks.count(b) for b in sorted(set(blocks))}
    assert sum(auto["block_histogram"].values()) == auto["cycles"] == sum(auto["accepted_histogram"])
    drafted = sum(b - 1 for b in blocks)
    accepted = sum(a for r in made["runs"] if r["block_size"] == "auto" for a in r["accepted"])
    assert auto["acceptance_rate"] == (accepted / drafted if drafted else None)
    console = Console(record=True, width=200)
    render(made, console)
    text = console.export_text()
    assert "DFlash b=auto" in text and "blocks used per cycle, b=auto" in text
