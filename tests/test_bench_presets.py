"""bench --predict presets for DFlash2 (qwen3.8-27b), Gemma 4 31B and
Qwen3-Coder-Next: each priced figure follows from the preset's shapes, a
DFlash2 draft pays for its selector, and the reports name the draft's
architecture. No timing is asserted; no model is loaded."""

import copy
import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.bench import cost_model as cm
from dflash_mlx.bench import report, runs
from dflash_mlx.bench.chips import find_chips
from dflash_mlx.bench.presets import PRESETS
from dflash_mlx.bench.render import render
from dflash_mlx.bench.schedule import Arm
from dflash_mlx.cli import app
from dflash_mlx.draft import default_target_layer_ids


def as_v1(draft: dict) -> dict:
    """The same draft without DFlash2's convolutions and selector."""
    v1 = copy.deepcopy(draft)
    v1["architectures"] = ["DFlashDraftModel"]
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        v1["dflash_config"].pop(key)
    return v1


def test_a_dflash2_draft_is_priced_as_its_conv_layers_plus_its_selector():
    target, draft, _, tau = PRESETS["qwen3.8-27b"]
    tp, dp, v1 = cm.target_profile(target), cm.draft_profile(draft), cm.draft_profile(as_v1(draft))
    assert (dp.architecture, v1.architecture) == ("dflash2", "v1")
    d = draft["dflash_config"]
    H, V, n = draft["hidden_size"], draft["vocab_size"], draft["num_hidden_layers"]
    K, G, R, k = d["conv_kernel_size"], H // d["conv_group_size"], d["selector_rank"], d["selector_top_k"]
    conv = 2 * n * (2 * K * H + 2 * K * G * H)  # two per layer: base_kernel, kernel_projection
    assert dp.params - v1.params == conv + R * H + 2 * V * R
    # bf16 codebooks are stored (weight_bytes) but a pass gathers rows, never the tables
    assert dp.weight_bytes - dp.layer_bytes == pytest.approx(2 * V * R * 2)
    assert dp.layer_bytes - v1.layer_bytes == pytest.approx(2 * (conv + R * H))
    b, context, rows = d["block_size"], 1024, d["block_size"] - 1
    assert b == 8 and (K, d["conv_group_size"], R) == (2, 16, 256)  # the published draft's
    full, base = dp.forward(tp, b, context, tau), v1.forward(tp, b, context, tau)
    # the top-k reads every logit of each drafted row; the scores gather 2k codebook rows
    selector_bytes = rows * (V * 2 + 2 * k * R * 2)
    assert full.bytes - base.bytes == pytest.approx(2 * (conv + R * H) + selector_bytes)
    # taps and projections at 2 FLOPs a weight a block token; the selector's projection,
    # top-k comparisons and every parent-candidate score per drafted row
    selector_flops = rows * (2 * R * H + V + (k + 2 * k * k) * R)
    assert full.flops - base.flops == pytest.approx(b * 2 * conv + selector_flops)
    (chip,) = find_chips(["M5 Max"])
    assert cm.predict(tp, dp, chip, tau, b).draft_ms > cm.predict(tp, v1, chip, tau, b).draft_ms


def test_a_quantized_dflash2_draft_gathers_quantized_codebook_rows():
    _, draft, _, _ = PRESETS["qwen3.8-27b"]
    R = draft["dflash_config"]["selector_rank"]
    q4 = cm.draft_profile({**draft, "quantization": {"bits": 4, "group_size": 64}})
    assert q4.codebook_row_bytes == pytest.approx(R / 2 + 2 * 2 * R / 64)  # packed + scale + bias
    assert cm.draft_profile(draft).codebook_row_bytes == pytest.approx(2 * R)
    wider = copy.deepcopy(draft)
    wider["dflash_config"]["selector_top_k"] *= 2
    k = draft["dflash_config"]["selector_top_k"]
    assert (cm.draft_profile(wider).selector(7).bytes - cm.draft_profile(draft).selector(7).bytes
            == pytest.approx(7 * 2 * k * 2 * R))  # k more successor and predecessor rows a row


def test_gemma_4_31b_preset_follows_its_published_shapes():
    target, draft, published, tau = PRESETS["gemma-4-31b"]
    tp, dp = cm.target_profile(target), cm.draft_profile(draft)
    text = target["text_config"]
    H, V = text["hidden_size"], text["vocab_size"]
    assert tp.params == pytest.approx(30.7e9, rel=0.002)  # as Google publishes it
    assert tp.head_bytes == pytest.approx(2 * V * H) and tp.embed_row_bytes == pytest.approx(2 * H)  # tied
    # 50 sliding layers of 16 KV heads x 256; 10 full of 4 x 512, whose values (K = V) are cached too
    types = text["layer_types"]
    assert types.count("sliding_attention") == 50 and types.count("full_attention") == 10
    assert tp.kv_bytes_per_pos == 2 * 2 * (50 * 16 * 256 + 10 * 4 * 512)
    # the draft: 1.63 GB at Q8_0 is 53% of its bf16 size; its ids are z-lab's rule for 60 layers
    assert dp.weight_bytes == pytest.approx(1.63e9 / 0.53, rel=0.01)
    assert draft["dflash_config"]["target_layer_ids"] == default_target_layer_ids(60, 6)
    assert dp.architecture == "v1" and dp.window is None and published is None and 1 < tau <= 16


def test_qwen3_coder_next_preset_follows_its_published_shapes():
    target, draft, _, _ = PRESETS["qwen3-coder-next-4bit"]
    tp, dp = cm.target_profile(target), cm.draft_profile(draft)
    assert tp.params == pytest.approx(80e9, rel=0.005)  # 80 B total
    assert tp.params - 2 * 151936 * 2048 == pytest.approx(79e9, rel=0.01)  # 79 B without embeddings
    assert tp.weight_bytes == pytest.approx(45e9, rel=0.02)  # about 45 GB at 4 bits
    assert (tp.num_experts, tp.experts_per_token) == (512, 10)
    # 36 Gated DeltaNet layers of 32 value heads of 128 x 128 (float32), 12 attention layers
    assert tp.state_bytes == 4.0 * 32 * 128 * 128 * 36
    assert tp.kv_bytes_per_pos == 2 * 12 * 2 * 2 * 256
    assert dp.params > 0 and draft["num_hidden_layers"] == 8 and draft["hidden_size"] == 2048


def test_cli_predict_names_the_drafts_architecture(tmp_path):
    runner = CliRunner()
    arch = {}
    for preset in ("qwen3.8-27b", "qwen3.5-9b", "gemma-4-31b", "qwen3-coder-next-4bit"):
        out = tmp_path / f"{preset}.json"
        res = runner.invoke(app, ["bench", "--predict", "--preset", preset, "--chip", "M5 Max", "--json", str(out)])
        assert res.exit_code == 0, res.output
        written = json.loads(out.read_text())
        arch[preset] = written["draft"]["architecture"]
        (row,) = written["predictions"]
        _, draft, _, tau = PRESETS[preset]
        assert (row["block_size"], row["tau"]) == (draft["dflash_config"]["block_size"], tau)
        if preset == "qwen3.8-27b":
            assert "DFlash2" in res.output and "top-16" in res.output
            assert written["draft"]["selector_top_k"] == 16
    assert arch == {"qwen3.8-27b": "dflash2", "qwen3.5-9b": "v1", "gemma-4-31b": "v1",
                    "qwen3-coder-next-4bit": "v1"}


def _measured(config_extra: dict) -> dict:
    """A report from run_bench with stand-in runners (no model), as the CLI writes it."""
    def fake(arm):
        def run(*args, tree_budget=None, draft_vocab=None):
            rec = {"prompt_tokens": 3, "tokens": [1, 2, 3], "generated": 3, "finish_reason": "length",
                   "prefill_s": 0.1, "decode_s": 0.2, "wall_s": 0.3, "prefill_tps": 30.0, "decode_tps": 10.0,
                   "reported_prompt_tps": None, "reported_generation_tps": None, "peak_memory_gb": 0.1}
            return {**rec, "cycles": 2, "accepted": [1, 0]} if arm == "dflash" else rec
        return run

    class Tok:
        bos_token = None
        has_chat_template = False

        def encode(self, text, add_special_tokens=True):
            return [len(w) for w in text.split()]

    prompts = [{"id": "a", "category": "math", "prompt": "one two three"}]
    result = runs.run_bench(None, None, Tok(), prompts, arms=[Arm(4)], max_tokens=3, repeat=1, warmup_tokens=0,
                            runners={"baseline": fake("baseline"), "dflash": fake("dflash")})
    config = {"model": "t", "draft": "d", "max_tokens": 3, "block_sizes": [4], "repeat": 1, "temperature": 0.0,
              "dtype": "checkpoint", "chat_template": False, "prompts": "test", **config_extra}
    return report.make_report(result, config, {"platform": "p", "mlx": "0", "backend": "cpu", "python": "3"})


@pytest.mark.parametrize("arch, shown", [({"draft_architecture": "dflash2"}, "t + d (DFlash2)"),
                                         ({"draft_architecture": "v1"}, "t + d (DFlash v1)"),
                                         ({}, "t + d:")])  # a report from before the key
def test_measured_reports_name_the_architecture_and_old_ones_still_validate(arch, shown, tmp_path):
    from rich.console import Console

    path = tmp_path / "r.json"
    report.write_json(_measured(arch), path)
    again = report.read_report(path)
    console = Console(record=True, width=250)
    render(again, console)
    assert shown in console.export_text()
