"""Confidence-scheduled verification (``ConfidenceSchedule``): the verified
length follows the cumulative products of a DSpark draft's confidences and the
cost curve, stops at the first drop of the expected rate, and leaves the output
the target's: greedy identical to mlx-lm (under a fixed and an adaptive block)
and, sampled, distributed as the target's own. ``confidence_schedule=False``
(``--confidence-schedule off``) turns it off under auto, and is refused where
no schedule would run."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from typer.testing import CliRunner

from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.cli import app
from dflash_mlx.loop.block_policy import AdaptiveBlock, ConfidenceSchedule, FixedBlock
from dflash_mlx.loop.cost_curve import CostCurve
from dflash_mlx.loop.decoder import DSparkProposer, SpeculativeDecoder
from test_cli_ignored import refused
from test_dspark import GAMMA, greedy_reference, write_dspark_draft
from test_dspark_sampling import ALPHA, PARAMS, POSITIONS, RUNS, draft, source, walk_proposer  # noqa: F401 (fixtures)
from test_sampling import exact_joint, model, pvalues, sample  # noqa: F401 (model: the fixture)

# a draft pass of 1 s; each verified token 0.3 s more (both per cycle, at any context)
CURVE = CostCurve(sizes=(1, 2, 8), target_s=(1.0, 1.3, 3.1), draft_s=(0.0, 1.0, 1.0))
# a cheap draft pass: speculating pays under "auto" whatever the schedule verifies
CHEAP = CostCurve(sizes=(1, 2, 8), target_s=(1.0, 1.3, 3.1), draft_s=(0.0, 0.1, 0.1))


def test_the_length_stops_at_the_first_drop():
    """Costs that fall again at b = 5 (a kernel's tile, say) would make 4
    drafts the best length overall, but the rate first drops at the second
    draft, so one is verified: the later drafts never weigh on the choice."""
    curve = CostCurve(sizes=(1, 2, 3, 4, 5, 8), target_s=(1.0, 1.0, 2.0, 2.0, 1.0, 1.0), draft_s=(0, 1, 1, 1, 1, 1))
    schedule = ConfidenceSchedule(curve)
    confident = [0.9, 0.9, 0.9, 0.9]
    assert schedule.length(confident, trained=7) == 1
    assert (1 + 0.9 + 0.81 + 0.729 + 0.6561) / 2.0 > (1 + 0.9) / 2.0  # 4 drafts would rate higher
    assert ConfidenceSchedule(CURVE).length([0.99] * 7, trained=7) == 7  # worth verifying every draft
    assert ConfidenceSchedule(CURVE).length([0.99, 0.2, 0.99], trained=7) == 1  # the rate drops at draft 2
    assert ConfidenceSchedule(CURVE).length([0.1] * 3, trained=7) == 1  # at least one draft: the policy speculated


@pytest.fixture(scope="module")
def pair(tmp_path_factory, target_dirs):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    path = tmp_path_factory.mktemp("dspark-schedule")
    write_dspark_draft(path, model, json.loads((target_dirs["qwen3"] / "config.json").read_text()))
    return model, tokenizer, load_draft(str(path))


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_greedy_output_is_mlx_lm_greedy_output(pair, policy):
    model, tokenizer, draft = pair
    target = Target(model)
    for text in ("the quick brown fox", "hello world what is"):
        prompt = tokenizer.encode(text)
        proposer = DSparkProposer(draft, target)
        proposer.schedule = ConfidenceSchedule(CURVE)
        chosen = FixedBlock(GAMMA + 1) if policy == "fixed" else AdaptiveBlock(CURVE, GAMMA + 1, prior=0.99)
        decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, chosen)
        out, widths = [decoder.prefill(mx.array(prompt))], []
        while len(out) < 24:
            out += decoder.cycle().tokens
            widths.append(decoder.drafted.size + 1 if decoder.drafted is not None else 1)
        assert out[:24] == greedy_reference(model, prompt, 24)
        if policy == "fixed":
            assert 1 < len(set(widths)), "the confidences must move the verified length here"


@pytest.mark.statistical
def test_sampled_output_follows_the_targets_distribution(model, draft):  # noqa: F811 (fixtures)
    """The lengths depend on the drafts drawn (c_k reads x_{k-1}), the case a
    search over every length would bias."""
    make, lengths = walk_proposer(draft), []

    class Counted(ConfidenceSchedule):
        def length(self, *args):
            lengths.append(super().length(*args))
            return lengths[-1]

    def scheduled(model, params, memo):
        proposer = make(model, params, memo)
        proposer.schedule = Counted(CURVE)
        return proposer

    tokens, _ = sample(model, PARAMS, proposer=scheduled, runs=RUNS, positions=POSITIONS)
    for position, p in pvalues(tokens, exact_joint(model, PARAMS, depth=POSITIONS)).items():
        assert p > ALPHA, f"{position} deviates from the target (p = {p:.2e})"
    assert 1 < len(set(lengths)), "the confidences must move the verified length here"


def confident_draft(target_dirs, tmp_path):
    """(model, tokenizer, draft, prompt ids, mlx-lm's greedy 32 tokens): a DSpark
    draft whose Markov head knows the target's greedy successor of each token,
    so it accepts long runs, and whose confidence head says c ~ 0."""
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    config = json.loads((target_dirs["qwen3"] / "config.json").read_text())
    cfg = write_dspark_draft(tmp_path, model, config, rank=config["vocab_size"])
    ids = tokenizer.encode("the quick brown fox")
    want = greedy_reference(model, ids, 32)
    V, path = cfg["vocab_size"], tmp_path / "model.safetensors"
    successor = np.zeros((V, V), dtype=np.float32)  # W2 W1[x] = 1000 at x's successor in the greedy text
    for x, y in zip(ids[-1:] + want, want):
        successor[y, x] = 1000.0
    weights = dict(mx.load(str(path)))
    weights["markov_head.markov_w1.weight"] = mx.array(np.eye(V, dtype=np.float32))
    weights["markov_head.markov_w2.weight"] = mx.array(successor)
    weights["confidence_head.proj.weight"] = mx.zeros_like(weights["confidence_head.proj.weight"])
    weights["confidence_head.proj.bias"] = mx.full((1,), -20.0)
    mx.save_safetensors(str(path), weights, metadata={"format": "pt"})
    return model, tokenizer, load_draft(str(tmp_path)), ids, want


def test_generate_schedules_a_confident_draft_under_auto(target_dirs, tmp_path):
    """Through ``generate``: the confident draft accepts long runs at a fixed
    block; its confidence head says c ~ 0, so under "auto" the schedule
    verifies one draft per cycle. Both outputs are mlx-lm's greedy output."""
    model, tokenizer, draft, ids, want = confident_draft(target_dirs, tmp_path)
    fixed = generate(model, draft, tokenizer, ids, max_tokens=32, block_size=GAMMA + 1)
    auto = generate(model, draft, tokenizer, ids, max_tokens=32, block_size="auto",
                    cost_curve=CHEAP)
    assert fixed.tokens == want and auto.tokens == want
    assert max(fixed.acceptance_lengths) > 2
    assert max(auto.acceptance_lengths) == 2  # one draft verified, and accepted


def test_the_schedule_turns_off_under_auto(target_dirs, tmp_path):
    """``confidence_schedule=False``: the same draft under "auto" verifies
    every draft of auto's block, so its long runs are accepted again (the
    schedule would verify one), and the output is still mlx-lm's greedy output."""
    model, tokenizer, draft, ids, want = confident_draft(target_dirs, tmp_path)
    off = generate(model, draft, tokenizer, ids, max_tokens=32, block_size="auto", cost_curve=CHEAP,
                   confidence_schedule=False)
    assert off.tokens == want
    assert max(off.acceptance_lengths) > 2


@pytest.mark.parametrize("extra, wanted", [
    ({"block_size": GAMMA + 1}, "a fixed block verifies every draft"),
    ({"tree_budget": 4}, "a tree verifies every node"),
    ({"confidence_schedule": "off"}, "must be True or False"),
])
def test_the_switch_is_refused_where_nothing_is_scheduled(pair, extra, wanted):
    model, tokenizer, draft = pair
    with pytest.raises(DFlashError, match=wanted):
        generate(model, draft, tokenizer, [1, 2, 3], max_tokens=4, **{"confidence_schedule": False, **extra})


def test_the_switch_is_refused_for_a_draft_without_a_confidence_head(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    with pytest.raises(DFlashError, match="the draft has no confidence head"):
        generate(model, load_draft(str(draft_dir("qwen3"))), tokenizer, [1, 2, 3], max_tokens=4, confidence_schedule=False)


def test_generate_on_the_command_line_takes_the_switch(pair, tmp_path, target_dirs):
    """``dflash-mlx generate --confidence-schedule off`` runs the DSpark draft
    under auto; typed where no schedule would run, it is one error line."""
    path = tmp_path / "draft"
    write_dspark_draft(path, pair[0], json.loads((target_dirs["qwen3"] / "config.json").read_text()))
    base = ["generate", "-m", target_dirs["qwen3"], "-d", path, "-p", "the quick", "-n", "8", "--no-chat-template"]
    done = CliRunner().invoke(app, [str(a) for a in base + ["--confidence-schedule", "off"]])
    assert done.exit_code == 0, done.output
    refused(base + ["--confidence-schedule", "on", "-b", "4"], "--confidence-schedule does nothing here: a fixed block")
    refused(base + ["--confidence-schedule", "maybe"], "'maybe' is not on or off")
