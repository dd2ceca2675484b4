"""Replaying a block policy over a reply's recorded acceptance
(``bench/replay.py``) makes exactly the real loop's cycles: the same blocks
and the same accepted drafts, for a fixed block and for auto on a given curve
(whose choices after a probe follow its outcome), on the demo pair's held-out
prompts; each cycle and probe priced on the curve."""

import pytest

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.bench.replay import acceptance_table, replay
from dflash_mlx.chat import template_ids
from dflash_mlx.demo import demo_pair
from dflash_mlx.loop.block_policy import AdaptiveBlock, FixedBlock
from dflash_mlx.loop.cost_curve import CostCurve
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
