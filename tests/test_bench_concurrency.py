"""``dflash-mlx bench --concurrency``: waves of requests at once, mlx-lm's batched
decoding beside our batch decoder, every reply identical to the request decoded
alone, the JSON report's fields, and bad widths refused. No timing is asserted."""

import io
import json

import pytest
from cli_run import cli, one_error_line
from rich.console import Console
from typer.testing import CliRunner

from dflash_mlx.bench.concurrency import waves
from dflash_mlx.bench.concurrency_report import DFLASH, MLX_LM, SCHEMA, render, validate_report
from dflash_mlx.bench.render import console
from dflash_mlx.cli import app

PROMPTS = [
    {"id": "a", "category": "math", "prompt": "the quick brown fox jumps over the lazy dog"},
    {"id": "b", "category": "chat", "prompt": "hello world what is the capital of france"},
    {"id": "c", "category": "chat", "prompt": "write a short story about a cat who"},
]


def test_waves_wrap_round_so_every_wave_is_full():
    assert waves(4, 2) == [[0, 1], [2, 3]]
    assert waves(3, 2) == [[0, 1], [2, 0]]
    assert waves(3, 8) == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert waves(2, 1) == [[0], [1]]


def concurrency_run(tmp_path, model, draft, prompts, *options):
    """``bench --concurrency`` with ``options``; (CLI output, the JSON report)."""
    path, out = tmp_path / "p.jsonl", tmp_path / "c.json"
    path.write_text("\n".join(json.dumps(p) for p in prompts))
    res = CliRunner().invoke(app, ["bench", "--model", str(model), "--draft", str(draft), "--prompts", str(path),
                                   "--no-warmup", "--json", str(out), *options])
    assert res.exit_code == 0, res.output
    return res.output, json.loads(out.read_text())


def check_report(report: dict, widths: list[int], n_prompts: int, repeat: int = 1) -> None:
    validate_report(report)
    assert report["schema"] == SCHEMA and report["config"]["concurrency"] == widths
    for w in widths:
        entry = report["summary"][str(w)]
        requests = len(waves(n_prompts, w)) * w * repeat
        for side in (MLX_LM, DFLASH):
            s = entry[side]
            assert s["requests"] == requests and s["generated"] > 0 and s["wall_s"] > 0
            assert s["tps_total"] > 0 and s["tps"]["median"] > 0
            assert 0 < s["ttft_s"]["median"] <= s["latency_s"]["median"] <= s["latency_s"]["max"]
            assert s["peak_memory_gb"] > 0
        ours = entry[DFLASH]
        assert ours["vs_solo"]["compared"] == ours["vs_mlx_lm"]["compared"] == requests
        assert ours["vs_solo"]["identical"] == requests, ours["vs_solo"]["divergences"]
        assert ours["vs_mlx_lm"]["identical"] + ours["vs_mlx_lm"]["near_ties"] == requests, ours["vs_mlx_lm"]
        assert ours["tau"] >= 1 and sum(ours["block_histogram"].values()) == ours["cycles"] > 0
        assert entry["speedup"]["median"] > 0 and entry["speedup_total"] > 0
    for run in report["runs"]:
        assert run["generated"] == sum(len(q["tokens"]) for q in run["requests"])
        assert all(q["first_s"] <= q["done_s"] <= run["wall_s"] for q in run["requests"])


def test_widths_one_and_two_on_a_tiny_pair(target_dirs, draft_dir, tmp_path):
    output, report = concurrency_run(tmp_path, target_dirs["qwen3"], draft_dir("qwen3", block_size=4), PROMPTS,
                                     "--concurrency", "1,2", "-n", "8", "-b", "4", "--no-chat-template")
    check_report(report, [1, 2], len(PROMPTS))
    # width 2 wraps round: waves (a, b) and (c, a); the sides alternate which goes first
    runs = [(r["width"], r["wave"], r["side"]) for r in report["runs"]]
    assert runs[:4] == [(1, 0, MLX_LM), (1, 0, DFLASH), (1, 1, DFLASH), (1, 1, MLX_LM)]
    assert [r["prompts"] for r in report["runs"] if r["width"] == 2][::2] == [[0, 1], [2, 0]]
    assert "mlx-lm tok/s" in output and "= alone" in output


def test_a_near_tie_note_does_not_squeeze_the_piped_table(target_dirs, draft_dir, tmp_path):
    """Piped output is wide enough for the table's natural width: a near-tie
    noted beside "= mlx-lm" once made it squeeze, wrapping "mlx-lm tok/s"."""
    _, report = concurrency_run(tmp_path, target_dirs["qwen3"], draft_dir("qwen3", block_size=4), PROMPTS[:2],
                                "--concurrency", "1", "-n", "4", "-b", "4", "--no-chat-template")
    for entry in report["summary"].values():
        entry[DFLASH]["vs_mlx_lm"]["near_ties"] = 1
    out = io.StringIO()
    render(report, Console(file=out, width=console().width))  # the width ``bench`` prints at when piped
    assert "(+1 near-tie)" in out.getvalue() and "mlx-lm tok/s" in out.getvalue()


def test_the_demo_pair_speculates_in_a_batch(tmp_path):
    """The demo pair's trained draft at a fixed block: rows accept drafts
    (tau above 1) and every reply is still the request's own."""
    from dflash_mlx.demo import demo_pair

    pair = demo_pair()
    prompts = [{"id": f"h{i}", "prompt": p} for i, p in enumerate(pair.load_prompts()[:2])]
    _, report = concurrency_run(tmp_path, pair.target, pair.draft, prompts,
                                "--concurrency", "2", "-n", "24", "-b", "8")
    check_report(report, [2], 2)
    assert report["summary"]["2"][DFLASH]["tau"] > 1
    blocks = report["summary"]["2"][DFLASH]["block_histogram"]
    assert "8" in blocks and all(int(b) <= 8 for b in blocks)  # smaller only where fewer tokens are left


def test_under_auto_the_warm_up_drafts_at_every_width(target_dirs, draft_dir):
    """A short auto wave runs plain steps, so the warm-up also drafts at the
    trained block: the batch's drafting work is first done off the clock."""
    from mlx_lm import load as mlx_lm_load

    from dflash_mlx import load_draft
    from dflash_mlx.bench.concurrency import run_concurrency

    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    result = run_concurrency(model, load_draft(str(draft_dir("qwen3", block_size=4))), tokenizer, PROMPTS[:2],
                             widths=[1, 2], max_tokens=6, block_size="auto", chat_template=False, warmup_tokens=6)
    assert [w["width"] for w in result["warmup"]] == [1, 2]
    assert all(max(w["blocks"]) > 1 for w in result["warmup"]), result["warmup"]


@pytest.mark.parametrize("value, wanted", [("0", "must be positive"), ("x", "'x' is not an integer"),
                                           ("", "names nothing"), ("2,-1", "must be positive")])
def test_bad_widths_are_one_error_line(value, wanted):
    one_error_line(cli("bench", "--concurrency", value), wanted)


def test_options_that_do_not_apply_are_refused():
    one_error_line(cli("bench", "--concurrency", "2", "--temp", "0.5"), "leave out --temp")
    one_error_line(cli("bench", "--concurrency", "2", "-b", "4,8"), "one --block-size")


# ---------------------------------------------------------------- the cost model with a batch dimension

def test_a_batch_reads_the_weights_once_and_pays_every_rows_flops():
    from dflash_mlx.bench import batch_cost as bc
    from dflash_mlx.bench import cost_model as cm
    from dflash_mlx.bench.chips import find_chips
    from dflash_mlx.bench.presets import PRESETS

    target_cfg, draft_cfg, _, tau = PRESETS["qwen3.5-9b"]
    tp, dp = cm.target_profile(target_cfg), cm.draft_profile(draft_cfg)
    one, four = bc.batch_forward(tp, 1, 16, 1024, 16), bc.batch_forward(tp, 4, 16, 1024, 16)
    assert one.bytes == pytest.approx(tp.forward(16, 1024, 16).bytes) and one.flops == tp.forward(16, 1024, 16).flops
    own = one.bytes - tp.dense_bytes - tp.head_bytes
    assert four.bytes == pytest.approx(tp.dense_bytes + tp.head_bytes + 4 * own) and four.flops == 4 * one.flops
    chip = find_chips(["M5 Max"])[0]
    alone = cm.predict(tp, dp, chip, tau, 16)
    batch = [bc.predict_batch(tp, dp, chip, tau, 16, n) for n in (1, 2, 4, 8, 16)]
    assert batch[0].speedup == pytest.approx(alone.speedup)
    assert batch[0].ar_tps == pytest.approx(alone.ar_tps) and batch[0].dflash_tps == pytest.approx(alone.dflash_tps)
    # plain steps stay on the weights while the verify pass turns compute-bound: the speedup falls with N
    assert [p.step_bound for p in batch] == ["memory"] * 5 and batch[-1].verify_bound == "compute"
    assert all(a.speedup >= b.speedup for a, b in zip(batch, batch[1:])) and batch[-1].speedup < 1
    assert all(a.ar_tps < b.ar_tps for a, b in zip(batch, batch[1:]))  # batched steps scale


def test_cli_predict_concurrency(tmp_path):
    out = tmp_path / "pb.json"
    res = CliRunner().invoke(app, ["bench", "--predict", "--preset", "qwen3.5-9b", "--chip", "M5 Max",
                                   "--concurrency", "1,8", "-b", "16,4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["predictions"]
    assert [(r["rows"], r["block_size"]) for r in rows] == [(1, 16), (1, 4), (8, 16), (8, 4)]
    assert rows[0]["tau"] == 7.5 and rows[1]["tau"] < 7.5
    assert rows[2]["speedup"] < rows[0]["speedup"]
    one_error_line(cli("bench", "--predict", "--preset", "qwen3.5-9b", "--concurrency", "2", "-b", "auto"),
                   "leave 'auto' out")
