"""``bench`` with a DSpark draft: the auto arm runs with and without its
confidence schedule (``--confidence-schedule on,off``) and the report names
which arm had it; the option is refused where no schedule would run.
``bench --predict`` prices DeepSeek's DSpark drafts (the ``qwen3-*-dspark``
presets) with their Markov and confidence heads."""

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.bench import cost_model as cm
from dflash_mlx.bench import report, runs
from dflash_mlx.bench.chips import find_chips
from dflash_mlx.bench.presets import PRESETS
from dflash_mlx.bench.schedule import Arm
from dflash_mlx.cli import app
from test_cli_ignored import refused
from test_dspark import write_dspark_draft
from test_dspark_schedule import CHEAP, confident_draft

PROMPTS = [{"id": "a", "category": "x", "prompt": "the quick brown fox"}]


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory, target_dirs):
    from mlx_lm import load as mlx_lm_load

    model, _ = mlx_lm_load(str(target_dirs["qwen3"]))
    path = tmp_path_factory.mktemp("dspark-bench")
    write_dspark_draft(path, model, json.loads((target_dirs["qwen3"] / "config.json").read_text()))
    return path


def bench(target_dirs, draft, tmp_path, *options):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "r.json"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS))
    args = ["bench", "-m", target_dirs["qwen3"], "-d", draft, "--prompts", prompts, "--no-warmup", "-n", "8",
            "--no-chat-template", "--json", out, *options]
    return [str(a) for a in args], out


def test_bench_runs_the_auto_arm_with_and_without_the_schedule(target_dirs, dspark_dir, tmp_path):
    args, out = bench(target_dirs, dspark_dir, tmp_path, "--confidence-schedule", "on,off")
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    written = report.read_report(out)
    assert written["config"]["confidence_schedules"] == [True, False]
    sides = written["summary"]["dflash"]
    assert set(sides) == {"auto", "auto-unscheduled"}
    assert sides["auto"]["confidence_schedule"] is True and sides["auto-unscheduled"]["confidence_schedule"] is False
    assert all(side["identical"] == side["compared"] == 1 for side in sides.values())
    assert "DFlash b=auto sched" in done.output and "DFlash b=auto unsched" in done.output
    assert {r["confidence_schedule"] for r in written["runs"] if r["arm"] == "dflash"} == {True, False}


def test_bench_names_the_schedule_of_a_dspark_drafts_default_auto_arm(target_dirs, dspark_dir, tmp_path):
    args, out = bench(target_dirs, dspark_dir, tmp_path, "-b", "auto,4")
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    written = report.read_report(out)
    assert written["config"]["confidence_schedules"] == [True]
    assert written["summary"]["dflash"]["auto"]["confidence_schedule"] is True
    assert written["summary"]["dflash"]["4"]["confidence_schedule"] is None
    assert "DFlash b=auto sched" in done.output


def test_the_unscheduled_arm_verifies_the_whole_block(target_dirs, tmp_path):
    """On the confident draft (its Markov head knows the greedy text, its
    confidences are ~0), the scheduled auto arm verifies one draft per cycle
    and the unscheduled one accepts longer runs; both are mlx-lm's output."""
    model, tokenizer, draft, ids, want = confident_draft(target_dirs, tmp_path)
    result = runs.run_bench(model, draft, tokenizer, [{"id": "a", "category": "x", "ids": ids}],
                            arms=[Arm("auto", None, True), Arm("auto", None, False)], max_tokens=32,
                            warmup_tokens=0, cost_curve=CHEAP)
    accepted = {r["confidence_schedule"]: max(r["accepted"]) for r in result["runs"] if r["arm"] == "dflash"}
    assert accepted[True] == 1 and accepted[False] > 1
    assert all(r["tokens"] == want for r in result["runs"])  # the baseline's and both arms'
    assert all(p["identical"] for p in result["pairs"])


@pytest.mark.parametrize("options, wanted", [
    (["-b", "4", "--confidence-schedule", "off"], "--confidence-schedule does nothing here: a fixed block"),
    (["--confidence-schedule", "sometimes"], "'sometimes' is not on or off"),
])
def test_bench_refuses_the_switch_where_nothing_is_scheduled(target_dirs, dspark_dir, tmp_path, options, wanted):
    args, out = bench(target_dirs, dspark_dir, tmp_path, *options)
    refused(args, wanted)
    assert not out.exists()


def test_bench_refuses_the_switch_for_a_draft_without_a_confidence_head(target_dirs, draft_dir, tmp_path):
    args, out = bench(target_dirs, draft_dir("qwen3", block_size=4), tmp_path, "--confidence-schedule", "off")
    refused(args, "the draft has no confidence head")


def test_bench_predict_refuses_the_switch():
    refused(["bench", "--predict", "--preset", "qwen3.5-9b", "--confidence-schedule", "off"],
            "leave out --confidence-schedule")


# ---------------------------------------------------------------- --predict

DSPARK_PRESETS = ["qwen3-4b-dspark", "qwen3-8b-dspark", "qwen3-14b-dspark"]


def without_heads(draft: dict) -> dict:
    """The same DSpark draft with neither Markov nor confidence head."""
    return {**draft, "markov_rank": 0, "enable_confidence_head": False, "confidence_head_with_markov": False}


@pytest.mark.parametrize("name, published_gb", [("qwen3-4b-dspark", 2.79), ("qwen3-8b-dspark", 4.74),
                                                ("qwen3-14b-dspark", None)])
def test_the_dspark_presets_are_deepseeks_drafts(name, published_gb):
    """The presets' drafts, with the two vocabulary-sized copies the checkpoints
    carry (dropped on load, so not in the profile), weigh what the hub lists."""
    target, draft, _, tau = PRESETS[name]
    dp = cm.draft_profile(draft)
    H, V = target["hidden_size"], target["vocab_size"]
    assert dp.architecture == "dspark" and dp.trained_tokens == draft["block_size"] == 7 and tau <= 8
    assert (dp.markov_rank, dp.markov_rows, dp.confidence_width) == (256, V, H + 256)
    if published_gb is not None:
        assert (dp.weight_bytes + 2 * V * H * 2) / 1e9 == pytest.approx(published_gb, abs=0.01)


@pytest.mark.parametrize("name", DSPARK_PRESETS)
def test_a_dspark_draft_is_priced_with_its_heads(name):
    """Per drafted row: a W1 row gathered, W2 [V, r] read whole and
    multiplied, U_k read and z_k written; the confidence head's row of H + r
    once, its dot per row. Without the heads the pass costs exactly that less."""
    target, draft, _, tau = PRESETS[name]
    tp, dp, bare = cm.target_profile(target), cm.draft_profile(draft), cm.draft_profile(without_heads(draft))
    H, V, r, rows = target["hidden_size"], target["vocab_size"], 256, 7
    full, base = dp.forward(tp, 8, 1024, tau), bare.forward(tp, 8, 1024, tau)
    assert full.bytes - base.bytes == pytest.approx(rows * (r * 2 + V * r * 2 + 2 * V * 2) + (H + r + 1) * 2)
    assert full.flops - base.flops == pytest.approx(rows * (2 * V * r + 2 * V + 2 * (H + r)))
    assert dp.weight_bytes - bare.weight_bytes == pytest.approx((2 * V * r + H + r + 1) * 2)
    (chip,) = find_chips(["M5 Max"])
    assert cm.predict(tp, dp, chip, tau, 8).draft_ms > cm.predict(tp, bare, chip, tau, 8).draft_ms


def test_a_dspark_drafts_backbone_runs_its_trained_block_at_any_b():
    target, draft, _, _ = PRESETS["qwen3-8b-dspark"]
    tp, dp = cm.target_profile(target), cm.draft_profile(draft)
    # b = 2 verifies one draft: the backbone still runs 7 tokens; one LM head row, one head step
    narrow, wide = dp.forward(tp, 2, 0, 1.0), dp.forward(tp, 8, 0, 1.0)
    per_row = tp.head_flops + 2 * 151936 * 256 + 2 * 151936 + 2 * (4096 + 256)
    assert wide.flops - narrow.flops == pytest.approx(6 * per_row)


def test_bench_predict_prices_the_dspark_presets():
    done = CliRunner().invoke(app, ["bench", "--predict", "--preset", "qwen3-8b-dspark", "--chip", "M5 Max"])
    assert done.exit_code == 0, done.output
    assert "DSpark (anchor-first block, Markov and confidence heads)" in done.output
    assert "rank-256 Markov head" in done.output
    refused(["bench", "--predict", "--preset", "qwen3-8b-dspark", "-b", "9"],
            "a DSpark draft drafts at most its trained block of 8")


def test_bench_predict_concurrency_prices_a_dspark_draft_up_to_its_trained_block():
    done = CliRunner().invoke(app, ["bench", "--predict", "--preset", "qwen3-8b-dspark", "--concurrency", "1,4",
                                    "--chip", "M5 Max"])
    assert done.exit_code == 0, done.output
    assert "b=8" in done.output
    refused(["bench", "--predict", "--preset", "qwen3-8b-dspark", "--concurrency", "2", "-b", "9"],
            "a DSpark draft drafts at most its trained block of 8")
