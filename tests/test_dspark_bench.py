"""``bench`` with a DSpark draft: the auto arm runs with and without its
confidence schedule (``--confidence-schedule on,off``) and the report names
which arm had it; the option is refused where no schedule would run."""

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.bench import report, runs
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
