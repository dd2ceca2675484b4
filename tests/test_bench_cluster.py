"""bench --predict --machines: the cross-machine rounds of a sharded target,
against figures worked out by hand."""

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx import DFlashError
from dflash_mlx.bench import cluster as c
from dflash_mlx.cli import app
from dflash_mlx.bench import cost_model as cm
from dflash_mlx.bench.chips import find_chips
from dflash_mlx.bench.presets import PRESETS

TIED = c.Shape(layers=2, hidden=4, vocab=10, tied=True, features=1)
UNTIED = c.Shape(layers=2, hidden=4, vocab=10, tied=False, features=1)
SLOW = c.Link("test", latency_us=10.0, bandwidth_gbs=1.0, source="test")


def test_collectives_on_a_ring_by_hand():
    assert c.all_reduce(24, 2) == c.Comm(2, 24)  # reduce-scatter and all-gather of half each
    assert c.all_reduce(30, 3) == c.Comm(4, 40)  # 4 steps of a third each
    assert c.all_gather(60, 2) == c.Comm(1, 30)
    assert c.Comm(9, 126).seconds(SLOW) == pytest.approx(9 * 10e-6 + 126 / 1e9)


def test_tensor_parallel_pass_by_hand():
    # 3 tokens of 4 bf16 activations = 24 bytes per all-reduce; 2 per layer, 2 layers
    assert c.pass_comm(TIED, "tensor", 2, tokens=3, logits_rows=3, dflash=True) == c.Comm(8, 96)
    # an untied head split over the vocabulary gathers 3 rows of 10 bf16 logits: one step, half of 60 bytes
    assert c.pass_comm(UNTIED, "tensor", 2, tokens=3, logits_rows=3, dflash=True) == c.Comm(9, 126)


def test_pipeline_pass_by_hand():
    # 3 machines, 2 tokens: 16 bytes of hidden state handed on twice, then one all-reduce
    # of the tapped feature and the last hidden state (32 bytes) for the draft
    assert c.pass_comm(TIED, "pipeline", 3, tokens=2, logits_rows=2, dflash=True) == c.Comm(2 + 4, 32 + 4 * 32 / 3)
    # mlx-lm's own pipeline all-gathers the last hidden state instead (3 x 16 bytes)
    assert c.pass_comm(TIED, "pipeline", 3, tokens=2, logits_rows=2, dflash=False) == c.Comm(2 + 2, 32 + 2 * 16)


@pytest.mark.parametrize("shape", [TIED, UNTIED])
@pytest.mark.parametrize("machines", [2, 4])
def test_a_verify_pass_costs_the_rounds_of_one_token_with_b_times_the_bytes(shape, machines):
    for mode in c.MODES:
        one = c.pass_comm(shape, mode, machines, tokens=1, logits_rows=1, dflash=True)
        for b in (4, 16):
            block = c.pass_comm(shape, mode, machines, tokens=b, logits_rows=b, dflash=True)
            assert block.steps == one.steps
            assert block.bytes == pytest.approx(b * one.bytes)


@pytest.fixture(scope="module")
def big():
    target, draft, _, tau = PRESETS["qwen3.5-397b-a17b-4bit"]
    return cm.target_profile(target), cm.draft_profile(draft), c.Shape.of(target, draft), tau


def test_the_397b_preset_has_its_published_size(big):
    tp, _, shape, _ = big
    assert 390e9 < tp.params < 400e9  # Qwen3.5-397B-A17B
    assert shape == c.Shape(layers=60, hidden=4096, vocab=248320, tied=False, features=5)


def test_a_free_link_leaves_the_one_machine_roofline(big):
    """With no latency and a near-infinite link, tensor parallelism over N machines
    divides the decode step's time by N and pipelining leaves it as on one machine."""
    tp, dp, shape, tau = big
    chip = find_chips(["M3 Ultra"])[0]
    free = c.Link("free", 0.0, 1e12, "test")
    one = cm.predict(tp, dp, chip, tau, 16, 1024)
    tensor = c.predict(tp, dp, shape, chip, free, 2, "tensor", tau, 16, 1024)
    pipeline = c.predict(tp, dp, shape, chip, free, 2, "pipeline", tau, 16, 1024)
    assert tensor.ar_tps == pytest.approx(2 * one.ar_tps, rel=1e-3)
    assert pipeline.ar_tps == pytest.approx(one.ar_tps, rel=1e-3)
    assert pipeline.speedup == pytest.approx(one.speedup, rel=1e-3)


def test_a_slower_link_favours_dflash_more(big):
    """The rounds cost per pass, not per token: a high-latency link slows mlx-lm's
    one-token steps far more than DFlash's cycles of tau tokens."""
    tp, dp, shape, tau = big
    chip = find_chips(["M3 Ultra"])[0]
    fast = c.predict(tp, dp, shape, chip, c.LINKS["tb5"], 2, "tensor", tau, 16, 1024)
    slow = c.predict(tp, dp, shape, chip, c.LINKS["tb5-ring"], 2, "tensor", tau, 16, 1024)
    assert fast.step_steps == fast.verify_steps == 2 * 2 * 60 + 1  # two all-reduces a layer, the logits gather
    assert slow.step_comm_ms == pytest.approx(241 * 0.3 + fast.step_comm_bytes / 10e9 * 1e3)
    assert slow.ar_tps < fast.ar_tps and slow.speedup > fast.speedup > 1


def test_link_figures_can_be_overridden_and_bad_ones_are_one_line():
    assert c.find_link("tb5") is c.LINKS["tb5"]
    mine = c.find_link("tb4-ring", latency_us=50.0)
    assert (mine.latency_us, mine.bandwidth_gbs) == (50.0, c.LINKS["tb4-ring"].bandwidth_gbs)
    assert mine.source.startswith("given on the command line")
    with pytest.raises(DFlashError, match="^unknown --link 'tb9'; known: tb5, tb5-ring, tb4-ring"):
        c.find_link("tb9")
    with pytest.raises(DFlashError, match="--link-gbs must be a positive number"):
        c.find_link("tb5", bandwidth_gbs=0.0)


def test_cli_prints_and_writes_the_cluster_prediction(tmp_path):
    out = tmp_path / "cluster.json"
    done = CliRunner().invoke(app, ["bench", "--predict", "--preset", "qwen3.5-397b-a17b-4bit", "--machines", "2",
                                    "--chip", "M3 Ultra", "--link", "tb5-ring", "--link-latency-us", "100",
                                    "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert "predicted decode speed on 2 Macs" in done.stdout and "tensor" in done.stdout
    report = json.loads(out.read_text())
    assert report["link"]["latency_us"] == 100.0 and report["link"]["bandwidth_gbs"] == 10.0
    assert {r["mode"] for r in report["predictions"]} == {"tensor", "pipeline"}
    assert all(r["machines"] == 2 and r["chip"] == "M3 Ultra" for r in report["predictions"])


@pytest.mark.parametrize("args, message", [
    (["--machines", "2"], "--machines prices a cluster with --predict"),
    (["--predict", "--preset", "qwen3.5-9b", "--machines", "2", "--link", "tb9"], "unknown --link 'tb9'"),
    (["--predict", "--preset", "qwen3.5-9b", "--machines", "2", "--tree-budget", "8"],
     "leave out --tree-budget: bench --predict --machines does not use it"),
    (["--calibrate", "--distributed", "tensor"], "--distributed applies to a measured run"),
])
def test_cli_cluster_options_refused_in_one_line(args, message):
    done = CliRunner().invoke(app, ["bench", *args])
    assert done.exit_code == 1
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), done.output
