"""bench --context: prompts of exact token lengths, the per-context table
beside mlx-lm, contexts past the target refused in one line; bench and
--predict with a quantized KV cache. No timing is asserted."""

import json
import statistics

import mlx.core as mx
import pytest
from checkpoints import write_draft, write_target
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from dflash_mlx import DFlashError
from dflash_mlx.bench import cost_model as cm
from dflash_mlx.bench.long_context import context_prompts, fitting, parse_context, stdlib_sources
from dflash_mlx.bench.presets import PRESETS
from dflash_mlx.bench.report import read_report
from dflash_mlx.cli import app


def bench(*args) -> tuple:
    res = CliRunner().invoke(app, ["bench", *map(str, args)])
    assert res.exit_code == 0, res.output
    return res


def test_context_lengths_as_typed():
    assert [parse_context(t) for t in ("4096", "4k", "3.5k", " 1K ", "100")] == [4096, 4096, 3584, 1024, 100]
    for bad in ("", "k", "4m", "0", "1.3", "-4k"):
        with pytest.raises(DFlashError, match="--context"):
            parse_context(bad)


def test_prompts_have_exact_lengths_and_are_the_same_every_time(target_dirs):
    _, tokenizer = mlx_lm_load(str(target_dirs["llama"]))
    prompts = context_prompts(tokenizer, [50, 300], per_context=3)
    assert [len(p["ids"]) for p in prompts] == [50] * 3 + [300] * 3
    assert [p["category"] for p in prompts] == ["50"] * 3 + ["300"] * 3
    assert len({tuple(p["ids"]) for p in prompts}) == 6  # each starts in another file
    assert prompts == context_prompts(tokenizer, [50, 300], per_context=3)
    assert stdlib_sources()[0].read_text()[:30] in prompts[0]["prompt"]  # Python's own sources


def test_contexts_past_the_target_are_skipped_in_one_line():
    lines = []
    assert fitting([1024, 4096, 2048], 128, 4096, lines.append) == [1024, 2048]
    assert lines == ["context 4k skipped: 4096 prompt tokens and 128 generated pass the target's 4096 "
                     "positions; use --synthetic --context for longer contexts"]
    with pytest.raises(DFlashError, match="no --context fits the target's 4096 positions"):
        fitting([4096, 8192], 1, 4096, lines.append)
    assert fitting([8192], 1, None, lines.append) == [8192]


def test_the_table_per_context_on_a_tiny_pair(target_dirs, draft_dir, tmp_path):
    out = tmp_path / "r.json"
    res = bench("--model", target_dirs["qwen3"], "--draft", draft_dir("qwen3", block_size=4),
                "--context", "64,100", "--context", "4k", "-n", 6, "-b", "4,auto", "--limit", 2,
                "--no-warmup", "--json", out)
    assert "warning: context 4k skipped: 4096 prompt tokens and 6 generated pass the target's 4096" in res.output
    assert "by context: DFlash beside mlx-lm" in res.output
    report = read_report(out)
    assert report["config"]["contexts"] == [64, 100]
    assert [(p["category"], p["prompt_tokens"]) for p in report["prompts"]] == [("64", 64)] * 2 + [("100", 100)] * 2
    assert all("ids" not in p for p in report["prompts"])
    rows = report["contexts"]
    assert [(r["context"], r["arm"]) for r in rows] == [("64", "4"), ("64", "auto"), ("100", "4"), ("100", "auto")]
    runs = report["runs"]
    for row in rows:
        mine = [r for r in runs if r["category"] == row["context"] and str(r["block_size"]) == row["arm"]]
        base = {r["prompt_id"]: r for r in runs if r["category"] == row["context"] and r["arm"] == "baseline"}
        ratios = [r["decode_tps"] / base[r["prompt_id"]]["decode_tps"] for r in mine]
        assert row["prompts"] == 2 and row["identical"] == 2
        assert row["speedup"] == pytest.approx(statistics.median(ratios))
        assert row["speedup_interval"] is None  # 2 pairs: too few for a 95% interval
        cycles = sum(r["cycles"] for r in mine)
        assert row["tau"] == pytest.approx((sum(map(sum, (r["accepted"] for r in mine))) + cycles) / cycles)
        assert row["dflash"]["ttft_s"] == pytest.approx(statistics.median(r["prefill_s"] for r in mine))
        assert row["baseline"]["prefill_tps"] == pytest.approx(
            statistics.median(r["prefill_tps"] for r in base.values()))
        assert row["dflash"]["peak_memory_gb"] == max(r["peak_memory_gb"] for r in mine)


def test_bench_with_a_quantized_kv_cache_on_both_sides(tmp_path):
    target_dir, draft_dir = tmp_path / "t", tmp_path / "d"
    config = write_target(target_dir, "llama", head_dim=32)
    write_draft(draft_dir, config, block_size=4)
    out = tmp_path / "r.json"
    bench("--model", target_dir, "--draft", draft_dir, "--context", "40", "--limit", 1, "-n", 12, "-b", 4,
          "--kv-bits", 4, "--kv-group-size", 32, "--quantized-kv-start", 20, "--no-warmup", "--json", out)
    report = read_report(out)
    assert report["config"]["kv"] == {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 20}
    (prompt,) = [p["prompt"] for p in report["prompts"]]
    base = next(r for r in report["runs"] if r["arm"] == "baseline")
    model, tokenizer = mlx_lm_load(str(target_dir))
    ids = context_prompts(tokenizer, [40], 1)[0]["ids"]
    want = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=12, kv_bits=4, kv_group_size=32,
                                        quantized_kv_start=20)]
    assert base["tokens"] == want[: len(base["tokens"])]
    assert report["summary"]["dflash"]["4"]["identical"] == 1


def test_bad_kv_and_context_options_are_one_line_errors(target_dirs, draft_dir):
    pair = ["--model", str(target_dirs["qwen3"]), "--draft", str(draft_dir("qwen3", block_size=4))]
    for args, words in [(["--kv-bits", "7"], "--kv-bits must be one of"),
                        (["--kv-bits", "4", "--synthetic"], "--kv-bits applies to"),
                        (["--context", "4x"], "'4x' is not a token count"),
                        (["--context", "1k", "--prompts", "demo"], "--context makes its own prompts"),
                        (["--predict", "--preset", "qwen3.5-9b", "--context", "1k,2k"], "prices one context"),
                        ([*pair, "--kv-bits", "4", "-n", "2", "--limit", "1", "--no-warmup"],
                         "kv_bits cannot serve this target: its head dimension 16")]:
        res = CliRunner().invoke(app, ["bench", *args])
        assert res.exit_code == 1 and words in res.output, (args, res.output)
        assert "Traceback" not in res.output


def test_predict_prices_the_quantized_kv_bytes(tmp_path):
    target, _, _, _ = PRESETS["qwen3.5-9b"]
    full, q4 = cm.target_profile(target), cm.target_profile(target, None, (4, 64))
    assert q4.kv_bytes_per_pos == pytest.approx(full.kv_bytes_per_pos * (0.5 + 2 * 2 / 64) / 2)  # bf16 cache
    reports = {}
    for name, extra in [("full", []), ("q4", ["--kv-bits", 4, "--quantized-kv-start", 0]),
                        ("late", ["--kv-bits", 4])]:
        path = tmp_path / f"{name}.json"
        res = bench("--predict", "--preset", "qwen3.5-9b", "--chip", "M5 Max", "-b", 16, "--context", "32k",
                    "--json", path, *extra)
        reports[name] = json.loads(path.read_text())
        if extra:
            assert "the target's KV cache at 32768 tokens" in res.output
    (full_row,), (q4_row,), (late_row,) = (reports[n]["predictions"] for n in ("full", "q4", "late"))
    assert reports["q4"]["kv_quantized"] and not reports["full"]["kv_quantized"]
    assert reports["late"]["kv_quantized"]  # 32k is past mlx-lm's default start of 5000
    assert q4_row["ar_tps"] > full_row["ar_tps"] and q4_row["dflash_tps"] > full_row["dflash_tps"]
    assert late_row == q4_row
