"""dflash-mlx bench with DDTree arms (--tree-budget): the trees beside the
chain in the same run, greedy identity (on the bundled demo pair, whose trained
draft gets drafts accepted), the report with and without tree arms, --predict
pricing a tree's verify over B+1 positions, and one-line errors for bad
budgets. No timing is asserted."""

import json
import shutil

import pytest
from test_bench import PROMPTS, bench_tiny_pair
from test_cli_errors import assert_one_error, dflash
from typer.testing import CliRunner

from dflash_mlx import DFlashError
from dflash_mlx.bench import cost_model as cm
from dflash_mlx.bench import report, runs
from dflash_mlx.bench.chips import Chip
from dflash_mlx.bench.command import parse_tree_budgets
from dflash_mlx.bench.render import plot, render
from dflash_mlx.bench.schedule import Arm, arms
from dflash_mlx.cli import app
from dflash_mlx.demo import demo_pair

def _rendered(made: dict) -> str:
    from rich.console import Console

    console = Console(record=True, width=240)
    render(made, console)
    return console.export_text()


def test_arms_and_budgets():
    assert [a.key for a in arms([16, "auto"], [32, 8], 16)] == ["16", "auto", "tree32@16", "tree8@16"]
    assert Arm(16, 32).label == "B=32 b=16" and Arm("auto").label == "b=auto"
    assert parse_tree_budgets(["32,0", "8", "32"]) == [32, 8]  # 0 is the chain, run anyway
    assert parse_tree_budgets(None) == []
    with pytest.raises(DFlashError, match="'x' is not an integer"):
        parse_tree_budgets(["8,x"])
    with pytest.raises(DFlashError, match=r"--tree-budget must be positive \(0: no tree\), got -1"):
        parse_tree_budgets(["-1"])


# ---------------------------------------------------------------- a run

@pytest.fixture(scope="module")
def tree_report():
    """The demo pair on two held-out prompts, greedy: the chain at b=4 and trees
    of 3 and 8 nodes at b=4."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.bench.prompts import select_prompts

    pair = demo_pair()
    if pair is None:
        pytest.skip("the bundled demo pair is not in this checkout")
    model, tokenizer = load(str(pair.target))
    result = runs.run_bench(model, load_draft(str(pair.draft)), tokenizer, select_prompts("demo", None, 2),
                            arms=arms([4], [3, 8], 4), max_tokens=16, chat_template=False, warmup_tokens=0)
    config = {"model": "t", "draft": "d", "max_tokens": 16, "block_sizes": [4], "tree_budgets": [3, 8],
              "tree_block_size": 4, "repeat": 1, "temperature": 0.0, "dtype": "checkpoint",
              "chat_template": False, "prompts": "demo"}
    return report.make_report(result, config, report.machine_info())


def test_tree_arms_run_beside_the_chain_identical_at_greedy(tree_report, tmp_path):
    report.validate_report(tree_report)
    path = tmp_path / "r.json"
    report.write_json(tree_report, path)
    again = report.read_report(path)
    assert list(again["summary"]["dflash"]) == ["4", "tree3@4", "tree8@4"]
    assert len(again["runs"]) == 2 * 4 and len(again["pairs"]) == 2 * 3
    prompts = [p["id"] for p in again["prompts"]]
    assert sorted({(r["block_size"], r["tree_budget"]) for r in again["runs"] if r["arm"] == "dflash"},
                  key=str) == [(4, 3), (4, 8), (4, None)]
    base = {r["prompt_id"]: r["tokens"] for r in again["runs"] if r["arm"] == "baseline"}
    for r in again["runs"]:
        assert r["tokens"] == base[r["prompt_id"]]  # every arm is the target's greedy output
    assert set(base) == set(prompts)
    for key, budget in (("tree3@4", 3), ("tree8@4", 8)):
        side = again["summary"]["dflash"][key]
        assert (side["block_size"], side["tree_budget"]) == (4, budget)
        assert side["identical"] == side["compared"] == 2, side["divergences"]
        assert len(side["accepted_histogram"]) == 4 and sum(side["accepted_histogram"]) == side["cycles"] > 0
        assert 1.0 <= side["tau"] <= 4 and side["peak_memory_gb"]["max"] > 0
        mine = [r for r in again["runs"] if r.get("tree_budget") == budget]
        accepted = sum(a for r in mine for a in r["accepted"])
        assert accepted > 0  # drafted nodes were committed, not just the target's own tokens
        assert side["acceptance_rate"] == pytest.approx(accepted / (budget * side["cycles"]))  # of B nodes
    # a tree's siblings catch the target's token at depth 1 where the chain's one draft misses
    chain, tree = again["summary"]["dflash"]["4"], again["summary"]["dflash"]["tree8@4"]
    assert tree["position_acceptance"][0] > chain["position_acceptance"][0]
    text = _rendered(again)
    assert "DFlash b=4" in text and "DDTree B=3 b=4" in text and "DDTree B=8 b=4" in text
    assert "accepted drafts per cycle, B=8 b=4" in text


def test_the_chart_draws_the_tree_arms(tree_report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.png"
    plot(tree_report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_diverging_tree_arm_is_reported(target_dirs, draft_dir):
    from dflash_mlx import load, load_draft

    model, tokenizer = load(str(target_dirs["qwen3"]))
    draft = load_draft(str(draft_dir("qwen3", block_size=4)))

    def corrupted(*args, tree_budget=None, draft_vocab=None):  # the tree's tokens, one changed
        rec = runs.run_dflash(*args, tree_budget=tree_budget)
        if tree_budget:
            rec["tokens"][2] = (rec["tokens"][2] + 1) % 500
        return rec

    result = runs.run_bench(model, draft, tokenizer, PROMPTS[:1], arms=arms([4], [3], 4), max_tokens=8,
                            chat_template=False, warmup_tokens=0, runners={"dflash": corrupted})
    chain, tree = result["summary"]["dflash"]["4"], result["summary"]["dflash"]["tree3@4"]
    assert chain["identical"] == 1 and tree["identical"] == 0
    assert [d["index"] for d in tree["divergences"]] == [2]


def test_reports_without_tree_arms_still_validate_and_render(tree_report):
    old = json.loads(json.dumps(tree_report))
    for key in ("tree_budgets", "tree_block_size"):
        old["config"].pop(key)
    for r in old["runs"] + old["pairs"]:
        r.pop("tree_budget", None)
    old["summary"]["dflash"] = {"4": old["summary"]["dflash"]["4"]}
    for key in ("block_size", "tree_budget"):
        old["summary"]["dflash"]["4"].pop(key)
    old["runs"] = [r for r in old["runs"] if r["arm"] == "baseline"]
    report.validate_report(old)
    assert "DFlash b=4" in _rendered(old)
    for breaking, msg in (
            (lambda r: r["summary"]["dflash"].pop("tree8@4"), "summary.dflash.tree8@4: expected an object"),
            (lambda r: r["config"].update(tree_budgets=[0]), "tree_budgets must be integers >= 1"),
            (lambda r: r["config"].update(tree_budgets="8"), "tree_budgets must be integers >= 1"),
            (lambda r: r["config"].update(tree_block_size=None), "tree_block_size an integer"),
            (lambda r: r["config"].update(tree_block_size=8), "summary.dflash.tree3@8: expected an object"),
            (lambda r: r["runs"][1].update(tree_budget=True), "tree_budget must be an integer")):
        bad = json.loads(json.dumps(tree_report))
        breaking(bad)
        with pytest.raises(DFlashError, match=msg):
            report.validate_report(bad)


def test_cli_runs_tree_arms_and_predicts_from_them(target_dirs, draft_dir, tmp_path):
    res, out = bench_tiny_pair(target_dirs, draft_dir, tmp_path, PROMPTS, "-n", "8", "-b", "2,4",
                               "--tree-budget", "0,3")
    assert "DDTree B=3 b=2" in res.output
    written = report.read_report(out)
    config = written["config"]
    assert (config["block_sizes"], config["tree_budgets"], config["tree_block_size"]) == ([2, 4], [3], 2)
    tree = written["summary"]["dflash"]["tree3@2"]  # at the first block size given
    assert tree["identical"] == tree["compared"] == 2
    # --predict from the report: the tree arm priced with its measured tau
    pred = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["bench", "--predict", "--results", str(out), "--chip", "M1",
                                   "--json", str(pred)])
    assert res.exit_code == 0, res.output
    rows = {(r["block_size"], r["tree_budget"]): r for r in json.loads(pred.read_text())["predictions"]}
    assert set(rows) == {(2, None), (4, None), (2, 3)}
    assert rows[2, 3]["tau"] == tree["tau"] and rows[2, 3]["tau_source"] == f"measured ({out})"
    assert "B=3 b=2: a DDTree of 3 nodes, verified in one target pass over 4 positions" in res.output


def test_cli_tree_arm_at_the_trained_block_when_only_auto(target_dirs, draft_dir, tmp_path):
    _, out = bench_tiny_pair(target_dirs, draft_dir, tmp_path, PROMPTS[:1], "-n", "6", "--tree-budget", "5")
    written = report.read_report(out)
    assert written["config"]["block_sizes"] == ["auto"] and written["config"]["tree_block_size"] == 4
    assert written["summary"]["dflash"]["tree5@4"]["identical"] == 1


# ---------------------------------------------------------------- --predict

CHIP = Chip("X", 1, bandwidth_gbs=100.0, fp32_tflops=1.0, neural_tflops=None, source="test")
DRAFT = cm.DraftProfile(params=0, layer_bytes=0.2e9, layer_flops=0.4e9, inject_flops=0.0,
                        kv_bytes_per_pos=0.0, attn_flops_per_pos=0.0)


def test_tree_verify_is_priced_over_b_plus_one_positions():
    target = cm.TargetProfile(params=0, dense_bytes=1e9, dense_flops=2e9, head_bytes=0.5e9,
                              head_flops=1e9, embed_row_bytes=0.0)
    chain = cm.predict(target, DRAFT, CHIP, tau=4.0, block_size=8, context=0)
    tree = cm.predict(target, DRAFT, CHIP, tau=4.0, block_size=8, context=0, tree_budget=11)
    # 12 positions (the pending token and 11 nodes), 12 logits rows: 12 * 2 + 12 * 1 GFLOP -> 36 ms;
    # 11 positions would be 33 ms, the chain's block of 8 is 24 ms
    assert tree.verify_ms == pytest.approx(36.0) and chain.verify_ms == pytest.approx(24.0)
    assert tree.draft_ms == pytest.approx(chain.draft_ms) == pytest.approx(10.2)  # the draft's pass at b
    assert tree.speedup == pytest.approx(4 * 15.0 / (36.0 + 10.2)) and tree.tree_budget == 11
    # memory-bound: the tree's kernel keeps per-node states on chip; it reads the context state once
    # more than the chain (the commit replays the path), not once per node
    states = cm.TargetProfile(params=0, dense_bytes=1e9, dense_flops=0.0, head_bytes=0.5e9, head_flops=0.0,
                              embed_row_bytes=0.0, state_bytes=0.1e9)
    assert cm.predict(states, DRAFT, CHIP, 4.0, 8, 0).verify_ms == pytest.approx(17.0)  # 1.5 + 2 x 0.1 GB
    assert cm.predict(states, DRAFT, CHIP, 4.0, 8, 0, tree_budget=11).verify_ms == pytest.approx(18.0)
    with pytest.raises(DFlashError, match="tau must lie in"):
        cm.predict(target, DRAFT, CHIP, tau=9.0, block_size=8, tree_budget=32)


def test_cli_predict_prices_the_tree_beside_the_chain(tmp_path):
    out = tmp_path / "p.json"
    base = ["bench", "--predict", "--preset", "qwen3.5-9b", "--chip", "M5 Max", "-b", "16", "--json", str(out)]
    res = CliRunner().invoke(app, [*base, "--tree-budget", "32", "--tree-tau", "8.5"])
    assert res.exit_code == 0, res.output
    chain, tree = json.loads(out.read_text())["predictions"]
    assert (chain["tree_budget"], tree["tree_budget"], tree["block_size"]) == (None, 32, 16)
    assert (tree["tau"], tree["tau_source"]) == (8.5, "given (--tree-tau)")
    assert tree["vs_chain"] == pytest.approx(tree["dflash_tps"] / chain["dflash_tps"])
    assert tree["break_even_tau"] == pytest.approx(8.5 / tree["vs_chain"])
    assert tree["verify_ms"] > chain["verify_ms"]
    assert "verified in one target pass over 33 positions" in res.output and "tie tau" in res.output
    # without --tree-tau: the chain's tau, no gain assumed, so the wider verify only costs
    res = CliRunner().invoke(app, [*base, "--tree-budget", "32"])
    assert res.exit_code == 0, res.output
    chain, tree = json.loads(out.read_text())["predictions"]
    assert tree["tau"] == chain["tau"] == 7.5 and "no tree gain assumed" in tree["tau_source"]
    assert tree["speedup"] < chain["speedup"] and tree["break_even_tau"] > 7.5
    assert tree["draft_ms"] == chain["draft_ms"]  # the same draft pass at b=16, tau 7.5 injected


@pytest.mark.parametrize("args, msg", [
    (["--tree-budget", "x"], "Invalid value for '--tree-budget': 'x' is not an integer"),
    (["--tree-budget", "-2"], "--tree-budget must be positive (0: no tree), got -2"),
    (["--predict", "--preset", "qwen3.5-9b", "--tree-budget", "300000"],
     "--tree-budget must be at most the target's context length 262144, got 300000"),
    (["--tree-tau", "3"], "only apply with --predict"),
    (["--predict", "--preset", "qwen3.5-9b", "--tree-tau", "3"], "--tree-tau needs --tree-budget"),
    (["--predict", "--preset", "qwen3.5-9b", "--tree-budget", "8", "--tree-tau", "17"],
     "--tree-tau must be at most the tree's block size 16"),
    (["--synthetic", "--tree-budget", "8"], "not --calibrate or --synthetic"),
])
def test_bad_tree_options_are_one_error_line(args, msg):
    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 1 and res.output.count("error:") == 1 and msg in res.output, res.output


def test_a_budget_beyond_the_context_fails_before_loading(target_dirs, draft_dir, tmp_path):
    """The target is its config.json alone (context 4096), the draft too: the
    check runs on them before any weight would load."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    for src, dst in ((target_dirs["qwen3"], target), (draft_dir("qwen3"), draft)):
        dst.mkdir()
        shutil.copy(src / "config.json", dst / "config.json")
    work = tmp_path / "work"
    work.mkdir()
    result = dflash("bench", "-m", target, "-d", draft, "--tree-budget", "8,5000", cwd=work)
    assert_one_error(result, "--tree-budget must be at most the target's context length 4096, got 5000")
    assert_one_error(dflash("bench", "-m", target, "-d", draft, "--tree-budget", "0,-1", cwd=work),
                     "--tree-budget must be positive (0: no tree), got -1")
    assert list(work.iterdir()) == []
