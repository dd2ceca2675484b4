"""Replaying a block policy over a reply's recorded acceptance
(``bench/replay.py``) makes exactly the real loop's cycles: the same blocks
and the same accepted drafts, for a fixed block and for auto on a given curve
(whose choices after a probe follow its outcome), on the demo pair's held-out
prompts; each cycle and probe priced on the curve. The schedule chosen in
hindsight is one the replay makes, and no policy replays faster."""

import random

import pytest

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.bench.replay import acceptance_table, hindsight, replay
from dflash_mlx.chat import template_ids
from dflash_mlx.demo import demo_pair
from dflash_mlx.loop.block_policy import AdaptiveBlock, FixedBlock
from dflash_mlx.loop.cost_curve import BlockScript, CostCurve
from dflash_mlx.targets import Target

TOKENS = 56
MAX_BLOCK = 8  # the demo draft's blocks, kept below its trained 16: a table row costs a pass per size
# drafting pays from about 2 drafts a cycle: plain steps, probes and blocks of several sizes
CURVE = CostCurve((1, 2, 4, 8, 16), (5.0, 7.0, 9.0, 12.0, 15.0), (0.0, 1.5, 2.0, 2.5, 3.5))


@pytest.fixture(scope="module")
def demo():
    pair = demo_pair()
    model, tokenizer = load(str(pair.target))
    draft = load_draft(str(pair.draft))
    draft.config.block_size = MAX_BLOCK  # auto's widest block, and the table's
    return model, draft, tokenizer, pair.load_prompts()[:2]


def real_cycles(model, draft, tokenizer, ids, **kwargs):
    responses = list(stream_generate(model, draft, tokenizer, ids, max_tokens=TOKENS, **kwargs))
    reply = [t for r in responses for t in r.tokens]
    return reply, [r.block_size for r in responses[1:]], [r.accepted for r in responses[1:]]


def test_the_replay_makes_the_real_loops_cycles(demo):
    model, draft, tokenizer, prompts = demo
    target = Target(model)
    probes, chosen = 0, set()
    for prompt in prompts:
        ids = template_ids(tokenizer, prompt)
        reply, blocks, accepted = real_cycles(model, draft, tokenizer, ids, block_size=7)
        table = acceptance_table(target, draft, ids, reply)
        assert len(table) == len(reply) == TOKENS
        fixed = replay(table, len(ids), FixedBlock(7), CURVE, TOKENS)
        assert (fixed.blocks, fixed.accepted, fixed.tokens) == (blocks, accepted, TOKENS)

        reply_auto, blocks, accepted = real_cycles(model, draft, tokenizer, ids, cost_curve=CURVE)
        assert reply_auto == reply  # the block never changes a greedy reply
        auto = replay(table, len(ids), AdaptiveBlock(CURVE, MAX_BLOCK), CURVE, TOKENS)
        assert (auto.blocks, auto.accepted) == (blocks, accepted)
        chosen.update(auto.blocks)
        probes += len(auto.probes)
        expected = sum(CURVE.cycle_seconds(b, len(ids) + sum(a + 1 for a in auto.accepted[:i]))
                       for i, b in enumerate(auto.blocks))
        assert auto.seconds == pytest.approx(expected + sum(CURVE.draft(b) for b in auto.probes))
    assert probes > 0 and 1 in chosen and len(chosen) > 2, "plain steps, probes and blocks of several sizes"


def test_hindsight_drafts_whole_blocks_where_every_draft_is_accepted_and_plain_steps_where_none_is():
    whole = [[b - 1 for b in range(2, MAX_BLOCK + 1)] for _ in range(41)]
    out = hindsight(whole, 10, CURVE, 41)
    assert out.tokens == 41 and out.blocks[:5] == [MAX_BLOCK] * 5  # 1 + 5 x 8
    assert out.accepted[:5] == [MAX_BLOCK - 1] * 5
    none = [[0] * (MAX_BLOCK - 1) for _ in range(41)]
    out = hindsight(none, 10, CURVE, 41)
    assert out.blocks == [1] * 40 and out.seconds == pytest.approx(40 * CURVE.cycle_seconds(1))


def test_no_block_policy_replays_faster_than_the_schedule_chosen_in_hindsight():
    rng = random.Random(0)
    for _ in range(20):
        table = []
        for _ in range(60):  # a run of right drafts, mostly the same whatever the block
            right = rng.choice([0, 0, 1, 2, 3, 5, 7, 7])
            table.append([min(b - 1, right + (rng.random() < 0.1)) for b in range(2, MAX_BLOCK + 1)])
        best = hindsight(table, 100, CURVE, 60)
        again = replay(table, 100, BlockScript(best.blocks), CURVE, 60)
        assert (again.blocks, again.accepted, again.tokens) == (best.blocks, best.accepted, best.tokens)
        assert again.seconds == pytest.approx(best.seconds)
        others = [FixedBlock(b) for b in range(1, MAX_BLOCK + 1)] + [AdaptiveBlock(CURVE, MAX_BLOCK)]
        assert all(replay(table, 100, policy, CURVE, 60).seconds >= best.seconds - 1e-9 for policy in others)
