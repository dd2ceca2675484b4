"""dflash-mlx bench: run order, identity checking, the statistics on synthetic runs,
the report schema, divergence reporting on tiny models, the prompt set and the
cost model's arithmetic. No timing is asserted."""

import json
import math

import numpy as np
import pytest
from checkpoints import build_target
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from test_dspark import write_dspark_draft
from typer.testing import CliRunner

from dflash_mlx import DFlashError
from dflash_mlx.bench import cost_model as cm
from dflash_mlx.bench import report, runs, summary
from dflash_mlx.bench.chips import Chip, find_chips
from dflash_mlx.bench.presets import PRESETS
from dflash_mlx.bench.prompts import CATEGORIES, builtin_prompts, load_prompts, select
from dflash_mlx.bench.render import render
from dflash_mlx.bench.schedule import BASELINE, DFLASH, Arm, schedule
from dflash_mlx.cli import app

PROMPTS = [
    {"id": "a", "category": "math", "prompt": "the quick brown fox jumps over the lazy dog"},
    {"id": "b", "category": "chat", "prompt": "hello world what is the capital of france"},
]


# ---------------------------------------------------------------- order

def test_schedule_interleaves_and_alternates():
    steps = schedule(2, 2, [Arm(16), Arm(8)])
    labels = [(s.repeat, s.prompt, s.label) for s in steps]
    unit0 = [(0, 0, "baseline"), (0, 0, "dflash b=16"), (0, 0, "dflash b=8")]
    unit1 = [(0, 1, "dflash b=8"), (0, 1, "dflash b=16"), (0, 1, "baseline")]
    unit2 = [(1, 0, "baseline"), (1, 0, "dflash b=16"), (1, 0, "dflash b=8")]
    unit3 = [(1, 1, "dflash b=8"), (1, 1, "dflash b=16"), (1, 1, "baseline")]
    assert labels == unit0 + unit1 + unit2 + unit3
    # an odd number of prompts still alternates across repeats
    firsts = [schedule(3, 2, [Arm(4)])[i].arm for i in range(0, 12, 2)]
    assert firsts == ["baseline", "dflash", "baseline", "dflash", "baseline", "dflash"]


def test_run_bench_calls_runners_in_schedule_order():
    calls = []

    def fake(arm):
        def run(*args, tree_budget=None, draft_vocab=None):
            block, tokens = (args[5], args[4]) if arm == "dflash" else (None, args[3])
            calls.append((arm, block, tokens))
            rec = {"prompt_tokens": 3, "tokens": [1, 2, 3], "generated": 3, "finish_reason": "length",
                   "prefill_s": 0.1, "decode_s": 0.2, "wall_s": 0.3, "prefill_tps": 30.0,
                   "decode_tps": 10.0, "reported_prompt_tps": None, "reported_generation_tps": None,
                   "peak_memory_gb": 0.0}
            if arm == "dflash":
                rec.update(cycles=2, accepted=[1, 0])
            return rec
        return run

    class Tok:
        bos_token = None
        has_chat_template = False

        def encode(self, text, add_special_tokens=True):
            return [len(w) for w in text.split()]

    out = runs.run_bench(None, None, Tok(), PROMPTS, arms=[Arm(4), Arm(8)], max_tokens=5, repeat=1,
                      warmup_tokens=2, runners={"baseline": fake("baseline"), "dflash": fake("dflash")})
    warm = [("baseline", None, 2), ("dflash", 4, 2), ("dflash", 8, 2)]
    timed = [("baseline", None, 5), ("dflash", 4, 5), ("dflash", 8, 5),
             ("dflash", 8, 5), ("dflash", 4, 5), ("baseline", None, 5)]
    assert calls == warm + timed
    assert [r["step"] for r in out["runs"]] == list(range(6))
    assert out["summary"]["dflash"]["4"]["identical"] == 2


# ---------------------------------------------------------------- identity

def test_a_run_is_timed_to_its_last_response_not_past_it():
    now = [0.0]

    def responses():
        now[0] = 1.0
        yield "first"
        now[0] = 3.0
        yield "last"
        now[0] = 10.0  # work after the last response (DFlash's closing sync) is off the clock

    assert runs._timed(responses(), clock=lambda: now[0]) == (["first", "last"], 1.0, 3.0)
    now[0] = 0.0
    assert runs._timed(iter(()), clock=lambda: now[0]) == ([], 0.0, 0.0)


def test_compare_tokens():
    assert summary.compare_tokens([1, 2, 3], [1, 2, 3]) == {"identical": True, "first_divergence": None}
    d = summary.compare_tokens([1, 2, 3, 4], [1, 2, 9, 4])
    assert not d["identical"]
    assert d["first_divergence"] == {"index": 2, "baseline": 3, "dflash": 9,
                                     "baseline_tokens": 4, "dflash_tokens": 4}
    d = summary.compare_tokens([1, 2, 3], [1, 2])  # DFlash stopped early
    assert d["first_divergence"]["index"] == 2
    assert d["first_divergence"]["baseline"] == 3 and d["first_divergence"]["dflash"] is None
    assert summary.compare_tokens([], [5])["first_divergence"]["index"] == 0
    assert summary.compare_tokens([], [])["identical"]


# ---------------------------------------------------------------- arithmetic on a synthetic run

def _run(step, pid, cat, arm, generated, decode_s, block=None, accepted=(), wall_s=1.0):
    rec = {"step": step, "prompt_id": pid, "category": cat, "repeat": 0, "arm": arm,
           "block_size": block, "prompt_tokens": 10, "tokens": list(range(generated)),
           "generated": generated, "finish_reason": "length", "prefill_s": 0.5, "decode_s": decode_s,
           "wall_s": wall_s, "prefill_tps": 20.0, "decode_tps": (generated - 1) / decode_s,
           "reported_prompt_tps": None, "reported_generation_tps": None, "peak_memory_gb": 1.0,
           "distinct_token_ratio": 1.0 if arm == DFLASH else 0.5 if pid == "p1" else 0.25}
    if arm == DFLASH:
        rec.update(cycles=len(accepted), accepted=list(accepted))
    return rec


def test_speedup_and_tau_arithmetic():
    runs = [
        _run(0, "p1", "math", BASELINE, 11, 2.0, wall_s=2.5),  # 5 tok/s
        _run(1, "p1", "math", DFLASH, 11, 0.5, 4, [3, 3, 1, 0], wall_s=1.0),  # 20 tok/s: 4.0x
        _run(2, "p2", "chat", DFLASH, 11, 1.0, 4, [0, 1, 2, 3, 0, 1], wall_s=2.0),  # 10 tok/s
        _run(3, "p2", "chat", BASELINE, 11, 5.0, wall_s=5.0),  # 2 tok/s: 5.0x
    ]
    pairs = summary.make_pairs(runs, compare=True)
    assert [(p["prompt_id"], p["baseline_step"], p["dflash_step"]) for p in pairs] == [("p1", 0, 1), ("p2", 3, 2)]
    assert pairs[0]["speedup"] == pytest.approx(4.0) and pairs[1]["speedup"] == pytest.approx(5.0)
    assert pairs[0]["wall_speedup"] == pytest.approx(2.5) and pairs[1]["wall_speedup"] == pytest.approx(2.5)
    assert pairs[0]["tau"] == pytest.approx(11 / 4) and pairs[1]["tau"] == pytest.approx(13 / 6)
    s = summary.summarize(runs, pairs, [Arm(4)])["dflash"]["4"]
    # 10 cycles, 14 accepted drafts: tau = (14 + 10) / 10; rate = 14 / (10 * 3)
    assert s["cycles"] == 10
    assert s["tau"] == pytest.approx(2.4)
    assert s["acceptance_rate"] == pytest.approx(14 / 30)
    assert s["accepted_histogram"] == [3, 3, 1, 3]
    assert s["position_acceptance"] == pytest.approx([0.7, 0.4, 0.3])
    assert s["tokens_per_cycle"] == pytest.approx(20 / 10)  # decode tokens after the prefill token
    assert s["speedup"]["median"] == pytest.approx(4.5)
    assert (s["speedup"]["min"], s["speedup"]["max"]) == (pytest.approx(4.0), pytest.approx(5.0))
    assert s["speedup"]["geomean"] == pytest.approx(math.sqrt(20))
    # aggregate: 20 tokens in 1.5 s against 20 tokens in 7 s
    assert s["speedup_total"] == pytest.approx((20 / 1.5) / (20 / 7.0))
    assert s["by_category"]["math"]["speedup"]["median"] == pytest.approx(4.0)
    assert s["by_category"]["chat"]["tau"] == pytest.approx(13 / 6)
    assert s["identical"] == 2 and s["compared"] == 2 and s["divergences"] == []
    base = summary.summarize(runs, pairs, [Arm(4)])["baseline"]
    assert base["decode_tps"]["median"] == pytest.approx(3.5) and base["wall_s"] == pytest.approx(7.5)
    assert base["distinct_token_ratio"]["median"] == pytest.approx(0.375)


def test_stats():
    s = summary.stats([3.0, None, 1.0, 2.0, 4.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (4, 2.5, 1.0, 4.0)
    assert (s["q1"], s["q3"]) == (pytest.approx(1.75), pytest.approx(3.25))
    assert summary.stats([None]) is None
    assert summary.stats([2.0])["q1"] == 2.0


def test_the_medians_interval_is_the_order_statistics_of_its_coverage():
    """x_(k) and x_(n+1-k) for the largest k covering 95% (the sign test's
    table: 6 values give the extremes, 15 the 4th and 12th, 30 the 10th and
    21st); the values may come in any order; under 6 values, none."""
    assert summary.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert summary.median_interval([float(x) for x in range(1, 7)]) == [1.0, 6.0]
    assert summary.stats(range(15, 0, -1))["median_interval"] == [4, 12]
    assert summary.median_interval(list(range(1, 31))) == [10, 21]


def test_the_medians_interval_covers_the_true_median_as_often_as_it_claims():
    """Over 2,000 samples of 15 ratios from a skewed distribution with a known
    median, the interval misses it in at most 5% of them (plus sampling
    slack), and in more than 1% (it is not the whole range)."""
    rng = np.random.default_rng(0)
    true_median = 1.0  # of lognormal(0, 0.2)
    misses = 0
    for _ in range(2000):
        low, high = summary.median_interval(sorted(rng.lognormal(0.0, 0.2, size=15)))
        misses += not low <= true_median <= high
    assert 0.01 < misses / 2000 <= 0.05 + 0.01


def test_sampling_pairs_are_not_compared():
    runs = [_run(0, "p", "c", BASELINE, 5, 1.0), _run(1, "p", "c", DFLASH, 5, 1.0, 4, [1, 1])]
    pairs = summary.make_pairs(runs, compare=False)
    s = summary.summarize(runs, pairs, [Arm(4)])["dflash"]["4"]
    assert pairs[0]["identical"] is None and s["identical"] is None and s["compared"] == 0


# ---------------------------------------------------------------- tiny models, end to end

@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    from dflash_mlx import load, load_draft

    model, tokenizer = load(str(target_dirs["qwen3"]))
    return model, load_draft(str(draft_dir("qwen3", block_size=4))), tokenizer


def test_report_schema_and_identity_on_tiny_models(pair, tmp_path):
    model, draft, tokenizer = pair
    result = runs.run_bench(model, draft, tokenizer, PROMPTS, arms=[Arm(4), Arm(2)], max_tokens=10,
                         chat_template=False, warmup_tokens=2)
    config = {"model": "t", "draft": "d", "max_tokens": 10, "block_sizes": [4, 2], "repeat": 1,
              "temperature": 0.0, "dtype": "checkpoint", "chat_template": False, "prompts": "test"}
    made = report.make_report(result, config, report.machine_info())
    report.validate_report(made)
    path = tmp_path / "r.json"
    report.write_json(made, path)
    again = report.read_report(path)
    assert again["machine"]["backend"] in ("cpu", "metal", "cuda")
    assert again["machine"]["mlx"]
    if again["machine"]["system"] == "Linux":
        assert "BLAS" in again["machine"]["blas"]
    assert len(again["runs"]) == 2 * 3 and len(again["pairs"]) == 2 * 2
    for b in ("4", "2"):
        side = again["summary"]["dflash"][b]
        assert side["identical"] == side["compared"] == 2, side["divergences"]
        assert sum(side["accepted_histogram"]) == side["cycles"] > 0
        assert 1.0 <= side["tau"] <= int(b)
    for run in again["runs"]:
        assert run["generated"] == len(run["tokens"]) <= 10
        assert run["peak_memory_gb"] > 0
        assert run["prefill_s"] >= 0 and run["decode_s"] >= 0
        assert run["distinct_token_ratio"] == len(set(run["tokens"])) / run["generated"]
    # the report text and table render without a terminal
    from rich.console import Console

    console = Console(record=True, width=200)
    render(again, console)
    text = console.export_text()
    assert "DFlash b=4" in text and "2/2" in text
    assert "distinct-token ratio of the baseline's output" in text
    assert "acceptance: share of cycles" in text
    for side in again["summary"]["dflash"].values():  # as if no arm ever accepted a draft (auto on plain steps)
        side.update(accepted_histogram=[side["cycles"]], position_acceptance=[])
    console = Console(record=True, width=80)
    render(again, console)
    text = console.export_text()
    assert "acceptance: no arm accepted a draft position" in text and "share of cycles" not in text


def test_divergence_is_reported(pair):
    model, draft, tokenizer = pair

    def corrupted(*args, **kwargs):  # DFlash, with one token changed
        rec = runs.run_dflash(*args, **kwargs)
        rec["tokens"][3] = (rec["tokens"][3] + 1) % 500
        return rec

    result = runs.run_bench(model, draft, tokenizer, PROMPTS[:1], arms=[Arm(4)], max_tokens=8,
                         chat_template=False, warmup_tokens=0, runners={"dflash": corrupted})
    side = result["summary"]["dflash"]["4"]
    assert side["identical"] == 0 and side["compared"] == 1
    (d,) = side["divergences"]
    base = next(r for r in result["runs"] if r["arm"] == BASELINE)["tokens"]
    assert d["prompt_id"] == "a" and d["index"] == 3
    assert d["baseline"] == base[3] and d["dflash"] == (base[3] + 1) % 500


@pytest.mark.parametrize("draft_ms, plain", [(1000.0, True), (0.001, False)])
def test_auto_runs_price_their_blocks_on_the_curve_the_bench_holds(pair, tmp_path, monkeypatch, draft_ms, plain):
    """Given a curve, every auto run prices on it and none measures one (a
    measurement inside a timed run would land in its prefill): a draft priced
    dear keeps every cycle plain, one priced nearly free speculates."""
    from dflash_mlx.loop import cost_curve as cc

    model, draft, tokenizer = pair
    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path))  # nothing cached: a run reading it would measure
    measured = []
    fallback = cc.CostCurve((1, 4), (1.0, 1.0), (0.0, 1.0))
    monkeypatch.setattr(cc, "measure", lambda *a, **k: measured.append(a) or fallback)
    curve = cc.CostCurve((1, 4), (0.01, 0.011), (0.0, draft_ms / 1000))
    result = runs.run_bench(model, draft, tokenizer, PROMPTS, arms=[Arm("auto")], max_tokens=16,
                            chat_template=False, warmup_tokens=2, cost_curve=curve)  # room for a guess at b = 4
    blocks = [b for r in result["runs"] if r["arm"] == DFLASH for b in r["blocks"]]
    assert measured == [] and blocks
    assert (set(blocks) == {1}) is plain


def test_divergence_from_another_target(pair, tmp_path):
    """The baseline side runs a differently seeded target: the mismatch shows."""
    model, draft, tokenizer = pair
    other, config = build_target("qwen3", seed=7)

    def other_baseline(_model, tok, ids, max_tokens, sampling):
        return runs.run_baseline(other, tok, ids, max_tokens, sampling)

    result = runs.run_bench(model, draft, tokenizer, PROMPTS, arms=[Arm(4)], max_tokens=8,
                         chat_template=False, warmup_tokens=0, runners={"baseline": other_baseline})
    side = result["summary"]["dflash"]["4"]
    assert side["identical"] < 2 and len(side["divergences"]) == 2 - side["identical"]


def test_validate_report_rejects_bad_reports(pair):
    good = {"schema": report.SCHEMA, "schema_version": report.SCHEMA_VERSION, "created": "now",
            "machine": {"platform": "p", "mlx": "0", "backend": "cpu", "python": "3"},
            "config": {"model": "t", "draft": "d", "max_tokens": 5, "block_sizes": [4], "repeat": 1,
                       "temperature": 0, "dtype": "float32", "chat_template": True, "prompts": "builtin"},
            "prompts": [], "runs": [], "pairs": [],
            "summary": summary.summarize([], [], [Arm(4)])}
    report.validate_report(good)
    for breaking in (lambda r: r.pop("runs"), lambda r: r.update(schema="other"),
                     lambda r: r["config"].update(max_tokens="5"),
                     lambda r: r["summary"]["dflash"]["4"].update(accepted_histogram=[0, 0]),
                     lambda r: r["runs"].append({"arm": "nope"})):
        bad = json.loads(json.dumps(good))
        breaking(bad)
        with pytest.raises(DFlashError):
            report.validate_report(bad)


# ---------------------------------------------------------------- prompts

def test_builtin_prompts():
    prompts = builtin_prompts()
    assert len(prompts) >= 30
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert {p["category"] for p in prompts} == set(CATEGORIES)
    for c in CATEGORIES:
        assert sum(p["category"] == c for p in prompts) >= 6
    long = [p for p in prompts if p["category"] == "summarize"]
    assert min(len(p["prompt"].split()) for p in long) > 600  # a long passage each


def test_load_and_select_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x", "category": "math", "id": "m1"}\n\n{"prompt": "y"}\n')
    assert load_prompts(f) == [{"id": "m1", "category": "math", "prompt": "x"},
                               {"id": "custom-3", "category": "custom", "prompt": "y"}]
    for text, msg in (('{"prompt": "x"}\nnot json\n', ":2: not valid JSON"),
                      ('{"category": "a"}\n', "'prompt'"),
                      ('{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n', "duplicate id"),
                      ("\n", "no prompts")):
        f.write_text(text)
        with pytest.raises(DFlashError, match=msg):
            load_prompts(f)
    picked = select(builtin_prompts(), limit=6)
    assert len(picked) == 6 and {p["category"] for p in picked} == set(CATEGORIES)
    assert {p["category"] for p in select(builtin_prompts(), ["code"])} == {"code"}
    with pytest.raises(DFlashError, match="no prompts in categories"):
        select(builtin_prompts(), ["poetry"])


# ---------------------------------------------------------------- cost model

def test_cost_model_arithmetic():
    chip = Chip("X", 1, bandwidth_gbs=100.0, fp32_tflops=1.0, neural_tflops=None, source="test")
    target = cm.TargetProfile(params=0, dense_bytes=1e9, dense_flops=2e9, head_bytes=0.5e9,
                              head_flops=1e9, embed_row_bytes=0.0)
    draft = cm.DraftProfile(params=0, layer_bytes=0.2e9, layer_flops=0.4e9, inject_flops=0.0,
                            kv_bytes_per_pos=0.0, attn_flops_per_pos=0.0)
    p = cm.predict(target, draft, chip, tau=4.0, block_size=8, context=0)
    # step: 1.5 GB / 100 GB/s = 15 ms vs 3 GFLOP / 1 TFLOP/s = 3 ms -> 15 ms
    assert p.step_ms == pytest.approx(15.0)
    # verify: 1.5 GB -> 15 ms vs 8 * 2 + 8 * 1 = 24 GFLOP -> 24 ms (compute bound)
    assert p.verify_ms == pytest.approx(24.0) and p.verify_bound == "compute"
    # draft: 0.7 GB -> 7 ms vs 8 * 0.4 + 7 * 1 = 10.2 GFLOP -> 10.2 ms
    assert p.draft_ms == pytest.approx(10.2)
    assert p.speedup == pytest.approx(4 * 15.0 / (24.0 + 10.2))
    assert p.ar_tps == pytest.approx(1000 / 15.0) and p.dflash_tps == pytest.approx(4000 / 34.2)
    # no overlap: step 18 ms, verify 15 + 24, draft 7 + 10.2
    assert p.speedup_serial == pytest.approx(4 * 18.0 / (39.0 + 17.2))
    with pytest.raises(DFlashError):
        cm.predict(target, draft, chip, tau=9.0, block_size=8)


def test_moe_experts_touched_and_tau_extrapolation():
    t = cm.TargetProfile(params=0, dense_bytes=0, dense_flops=0, head_bytes=0, head_flops=0,
                         embed_row_bytes=0, expert_bytes=1.0, num_experts=8, experts_per_token=2)
    assert t.experts_touched(1) == pytest.approx(2.0)
    assert t.experts_touched(2) == pytest.approx(8 * (1 - 0.75**2))
    assert t.forward(4, 0, 0).bytes == pytest.approx(8 * (1 - 0.75**4))
    a = cm.geometric_alpha(4.0, 8)
    assert (1 - a**8) / (1 - a) == pytest.approx(4.0, rel=1e-6)
    assert cm.tau_at(8, 4.0, 8) == 4.0
    assert cm.tau_at(4, 4.0, 8) == pytest.approx((1 - a**4) / (1 - a))
    assert cm.tau_at(3, 4.0, 8, [0.9, 0.5, 0.2]) == pytest.approx(2.4)  # 1 + P(a>=1) + P(a>=2)
    assert cm.geometric_alpha(1.0, 8) == 0.0 and cm.tau_at(16, 8.0, 8) == pytest.approx(16.0)


def test_profiles_count_every_weight():
    model, config = build_target("qwen3_5")
    total = sum(p.size for _, p in tree_flatten(model.parameters()))
    prof = cm.target_profile(config, "float32")
    assert prof.params == total
    assert prof.weight_bytes == pytest.approx(4 * total)
    # tied embeddings: the head is the embedding matrix, read whole; rows otherwise
    V, H = 512, 64
    assert prof.head_bytes == pytest.approx(4 * V * H) and prof.embed_row_bytes == pytest.approx(4 * H)
    assert prof.state_bytes > 0 and prof.kv_bytes_per_pos > 0
    # 4-bit, group 64, bf16 scales: 0.5 + 4/64 bytes per quantizable weight
    q = cm.target_profile({**config, "quantization": {"bits": 4, "group_size": 64}}, "bfloat16")
    assert q.weight_bytes < prof.weight_bytes / 6
    target, draft_cfg, published, tau = PRESETS["qwen3.5-9b"]
    assert cm.target_profile(target).params == pytest.approx(8.95e9, rel=0.01)  # as published
    assert cm.draft_profile(draft_cfg).params == pytest.approx(1.24e9, rel=0.02)


def test_preset_prediction_brackets_published_9b():
    """Qwen3.5-9B, tau 7.5, M5 Max: the measured 4.37x lies between the bounds."""
    target, draft, published, tau = PRESETS["qwen3.5-9b"]
    (chip,) = find_chips(["M5 Max"])
    p = cm.predict(cm.target_profile(target), cm.draft_profile(draft), chip, tau, 16)
    assert p.speedup_serial < published < p.speedup


def test_a_reduced_drafting_vocabulary_reads_and_multiplies_its_share_of_the_head():
    target, draft, _, tau = PRESETS["qwen3.5-9b"]
    tp, dp = cm.target_profile(target), cm.draft_profile(draft)
    full, reduced = dp.forward(tp, 16, 1024, tau), dp.forward(tp, 16, 1024, tau, head_share=0.125)
    assert full.bytes - reduced.bytes == pytest.approx(0.875 * tp.head_bytes)
    assert full.flops - reduced.flops == pytest.approx(0.875 * 15 * tp.head_flops)
    (chip,) = find_chips(["M5 Max"])
    faster = cm.predict(tp, dp, chip, tau, 16, head_share=0.125)
    assert faster.draft_ms < cm.predict(tp, dp, chip, tau, 16).draft_ms
    assert faster.verify_ms == cm.predict(tp, dp, chip, tau, 16).verify_ms  # verification keeps the full head


# ---------------------------------------------------------------- CLI

def test_cli_predict_draft_vocab(tmp_path):
    runner = CliRunner()
    speeds = {}
    for vocab in (None, "32768"):
        out = tmp_path / f"p{vocab}.json"
        res = runner.invoke(app, ["bench", "--predict", "--preset", "qwen3.5-9b", "--chip", "M5 Max",
                                  "-b", "16", "--json", str(out), *(["--draft-vocab", vocab] if vocab else [])])
        assert res.exit_code == 0, res.output
        written = json.loads(out.read_text())
        assert written["draft_vocab"] == (int(vocab) if vocab else None)
        speeds[vocab] = written["predictions"][0]["dflash_tps"]
    assert "32768 of the LM head's 248320 rows" in res.output and speeds["32768"] > speeds[None]
    res = runner.invoke(app, ["bench", "--predict", "--preset", "qwen3.5-9b", "--draft-vocab", "300000"])
    assert res.exit_code == 1 and "at most the target's vocabulary size 248320" in res.output


def test_cli_predict_and_errors(tmp_path):
    runner = CliRunner()
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["bench", "--predict", "--preset", "qwen3.5-9b", "--chip", "M5 Max",
                              "-b", "8,16", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["predictions"]
    assert [(r["chip"], r["block_size"]) for r in rows] == [("M5 Max", 8), ("M5 Max", 16)]
    assert rows[1]["tau"] == 7.5 and rows[0]["tau"] < 7.5
    for args, msg in ((["--tau", "3"], "only apply with --predict"),
                      (["-b", "1"], "at least 2"),
                      (["--predict", "--chip", "M9"], "tau"),
                      (["--predict", "--preset", "nope"], "unknown preset"),
                      (["--predict", "--preset", "qwen3.5-9b", "--chip", "M9"], "unknown chip")):
        res = runner.invoke(app, ["bench", *args])
        assert res.exit_code == 1 and msg in res.output, (args, res.output)


def bench_tiny_pair(target_dirs, draft_dir, tmp_path, prompts, *options):
    """``dflash-mlx bench`` on the tiny qwen3 pair (draft trained at block 4),
    no warm-up; (CLI result, path of its JSON report)."""
    path, out = tmp_path / "p.jsonl", tmp_path / "r.json"
    path.write_text("\n".join(json.dumps(p) for p in prompts))
    res = CliRunner().invoke(app, [
        "bench", "--model", str(target_dirs["qwen3"]), "--draft", str(draft_dir("qwen3", block_size=4)),
        "--prompts", str(path), "--no-warmup", "--json", str(out), *options])
    assert res.exit_code == 0, res.output
    return res, out


def test_cli_bench_end_to_end(target_dirs, draft_dir, tmp_path):
    res, out = bench_tiny_pair(target_dirs, draft_dir, tmp_path, PROMPTS, "-n", "6", "-b", "4")
    written = report.read_report(out)
    assert written["config"]["block_sizes"] == [4] and written["config"]["dtype"] in ("float32", "checkpoint")
    assert written["summary"]["dflash"]["4"]["identical"] == 2
    # --predict from the measured report: tau and the pair come from it
    res = CliRunner().invoke(app, ["bench", "--predict", "--results", str(out), "--chip", "M1"])
    assert res.exit_code == 0, res.output
    assert "M1" in res.output


def test_bench_names_a_dspark_drafts_architecture(target_dirs, tmp_path):
    model, _ = mlx_lm_load(str(target_dirs["qwen3"]))
    draft = tmp_path / "dspark"
    draft.mkdir()
    write_dspark_draft(draft, model, json.loads((target_dirs["qwen3"] / "config.json").read_text()))
    path, out = tmp_path / "p.jsonl", tmp_path / "r.json"
    path.write_text(json.dumps(PROMPTS[0]))
    res = CliRunner().invoke(app, ["bench", "--model", str(target_dirs["qwen3"]), "--draft", str(draft),
                                   "--prompts", str(path), "--no-warmup", "--json", str(out), "-n", "6", "-b", "6"])
    assert res.exit_code == 0, res.output
    assert "(DSpark)" in res.output
    written = report.read_report(out)
    assert written["config"]["draft_architecture"] == "dspark"
    assert written["config"]["draft_trained_block_size"] == 6  # gamma 5 and the anchor
    assert written["summary"]["dflash"]["6"]["identical"] == 1


# ---------------------------------------------------------------- cycle phases

def test_cycle_phases_runs_the_loops_cycles_phase_by_phase():
    """The phase-by-phase replica of a cycle accepts exactly what the real loop
    accepts, cycle for cycle, on the demo pair's trained DFlash2 draft: as
    ``stream_generate`` drafts (the candidate selector's walk, not the argmax)."""
    import mlx.core as mx

    from dflash_mlx import load, load_draft, stream_generate
    from dflash_mlx.bench.cycle_phases import PHASES, cycle_phases
    from dflash_mlx.demo import demo_pair

    pair = demo_pair()
    model, tokenizer = load(str(pair.target))
    draft = load_draft(str(pair.draft))
    prompts = [mx.array(tokenizer.encode(p)) for p in pair.load_prompts()[:2]]
    result = cycle_phases(model, draft, prompts, block=8, max_tokens=48)
    assert result["accepted"] == result["loop_accepted"]
    streamed = []
    for prompt in prompts:  # the cycles the replica runs: until 48 tokens are made
        made = 1
        for r in stream_generate(model, draft, tokenizer, prompt, block_size=8, max_tokens=64):
            if r.block_size > 1 and made < 48:
                streamed.append(r.accepted)
                made += r.accepted + 1
    assert result["accepted"] == streamed
    assert max(result["accepted"]) > 0 and result["tau"] > 1
    assert all(result["phases"][p]["eval_ms"] > 0 for p in PHASES)
    assert result["loop_cycle_ms"] > 0 and result["t_ar_ms"] > 0 and result["verify_nodes"] > 0
