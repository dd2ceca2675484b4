"""The draft's dtype per chip (float32 where bfloat16 is emulated), its override,
and the stop when a draft's logits are not finite (dflash_mlx/precision.py,
loop/decoder.py)."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from checkpoints import write_dflash2_draft, write_draft
from cli_run import cli, one_error_line
from dflash_mlx import DFlashError, load, load_draft, stream_generate
from dflash_mlx.cli import app
from dflash_mlx.precision import bf16_emulated, choose_draft_dtype

# device descriptions as mx.device_info() gives them on each machine
M1_MAX = {"architecture": "applegpu_g13s", "device_name": "Apple M1 Max", "memory_size": 64 * 2**30}
M2 = {"architecture": "applegpu_g14g", "device_name": "Apple M2"}
M3_PRO = {"architecture": "applegpu_g15s", "device_name": "Apple M3 Pro"}
M4_MAX = {"architecture": "applegpu_g16s", "device_name": "Apple M4 Max"}
LINUX_CPU = {"architecture": "x86_64", "device_name": "AMD EPYC"}


@pytest.mark.parametrize("info, emulated", [(M1_MAX, True), (M2, True), ({"device_name": "Apple M2 Ultra"}, True),
                                            (M3_PRO, False), (M4_MAX, False), (LINUX_CPU, False), ({}, False)])
def test_m1_and_m2_compute_drafts_in_float32_others_keep_the_checkpoint(info, emulated):
    assert bf16_emulated(info) is emulated
    dtype, why = choose_draft_dtype(info)
    assert dtype == (mx.float32 if emulated else None)
    assert ("emulates bfloat16" in why) is emulated


def test_the_override_wins_on_every_chip_and_a_bad_value_is_one_line():
    assert choose_draft_dtype(M1_MAX, "keep")[0] is None
    assert choose_draft_dtype(M1_MAX, "float16")[0] == mx.float16
    assert choose_draft_dtype(M4_MAX, "float32")[0] == mx.float32
    with pytest.raises(DFlashError, match="--draft-dtype must be one of auto, keep, float32") as e:
        choose_draft_dtype(M4_MAX, "fp8")
    assert "\n" not in str(e.value)


def test_load_draft_casts_every_floating_parameter(draft_dir):
    path = draft_dir("llama", dtype="bfloat16")
    def dtypes(draft):
        return {v.dtype for _, v in tree_flatten(draft.parameters())}

    assert dtypes(load_draft(str(path), dtype="keep")) == {mx.bfloat16}
    assert dtypes(load_draft(str(path), dtype="float32")) == {mx.float32}
    assert dtypes(load_draft(str(path))) == {mx.bfloat16}  # this CPU is no M1/M2: auto keeps it


def _poison(path, name="fc.weight"):
    """One weight of a saved draft set to NaN, on disk."""
    file = next(path.glob("model*.safetensors"))
    weights = mx.load(str(file))
    weights[name] = mx.full(weights[name].shape, float("nan"), dtype=weights[name].dtype)
    mx.save_safetensors(str(file), weights)


@pytest.mark.parametrize("tree_budget", [None, 6])
@pytest.mark.parametrize("dflash2", [False, True])
def test_a_draft_with_nan_weights_stops_with_one_line_and_emits_only_target_tokens(tmp_path, target_dirs, dflash2,
                                                                                   tree_budget):
    config = json.loads((target_dirs["llama"] / "config.json").read_text())
    (write_dflash2_draft if dflash2 else write_draft)(tmp_path, config, block_size=4)
    _poison(tmp_path)
    model, tokenizer = load(str(target_dirs["llama"]))
    prompt = [1, 5, 9, 14, 3]
    emitted = []
    with pytest.raises(DFlashError, match="non-finite logits") as e:
        for r in stream_generate(model, load_draft(str(tmp_path)), tokenizer, prompt, block_size=4, max_tokens=24,
                                 tree_budget=tree_budget):
            emitted += r.tokens
    assert "\n" not in str(e.value) and "--draft-dtype float32" in str(e.value)
    want = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]
    assert emitted == want[: len(emitted)]  # only the target's own tokens came out
    assert len(emitted) < 24


def test_the_cli_stops_a_nan_draft_with_one_error_line_on_the_chain_and_the_tree(tmp_path, target_dirs):
    config = json.loads((target_dirs["llama"] / "config.json").read_text())
    write_draft(tmp_path, config, block_size=4)
    _poison(tmp_path)
    for tree in ([], ["--tree-budget", "6"]):
        run = cli("generate", "--model", target_dirs["llama"], "--draft", tmp_path, "-p", "hello world", "-b", "4",
                  "--max-tokens", "16", "--no-chat-template", *tree)
        one_error_line(run, "the draft produced non-finite logits")


def test_generate_refuses_a_bad_draft_dtype_before_loading():
    result = CliRunner().invoke(app, ["generate", "-p", "hi", "--draft-dtype", "half"])
    assert result.exit_code == 1
    assert "--draft-dtype must be one of" in result.output and result.output.count("\n") == 1


def test_bench_takes_draft_dtype_apart_from_dtype_and_reports_it(target_dirs, draft_dir, tmp_path):
    from test_bench import PROMPTS, bench_tiny_pair

    _, out = bench_tiny_pair(target_dirs, draft_dir, tmp_path, PROMPTS[:1], "-n", "4", "-b", "4",
                             "--dtype", "float32", "--draft-dtype", "float16")
    config = json.loads(out.read_text())["config"]
    assert (config["dtype"], config["draft_dtype"]) == ("float32", "float16")
    _, out = bench_tiny_pair(target_dirs, draft_dir, tmp_path, PROMPTS[:1], "-n", "4", "-b", "4", "--dtype", "float32")
    assert json.loads(out.read_text())["config"]["draft_dtype"] == "float32"  # auto: the draft follows --dtype


@pytest.mark.parametrize("args, wanted", [(["--draft-dtype", "half"], "--draft-dtype must be one of"),
                                          (["--predict", "--preset", "qwen3.5-9b", "--draft-dtype", "float32"],
                                           "--draft-dtype applies to a measured run")])
def test_bench_refuses_a_bad_draft_dtype_in_one_line(args, wanted):
    one_error_line(cli("bench", *args), wanted)


@pytest.mark.parametrize("draft_dtype, shown", [("auto", "float32"), ("float16", "float16")])
def test_serve_loads_the_draft_in_draft_dtype_and_health_names_it(target_dirs, draft_dir, draft_dtype, shown):
    from fastapi.testclient import TestClient

    from dflash_mlx.server.app import Settings, create_app
    from dflash_mlx.server.engine import Engine

    engine = Engine(str(target_dirs["llama"]), str(draft_dir("llama", block_size=4)), block_size=4,
                    draft_dtype=draft_dtype)  # the tiny draft is stored in float32
    engine.start()
    try:
        health = TestClient(create_app(engine, Settings("t", 64, None, None))).get("/health").json()
    finally:
        engine.stop()
    assert health["pair"]["draft_dtype"] == shown


def test_serve_refuses_a_bad_draft_dtype_before_loading():
    result = CliRunner().invoke(app, ["serve", "--draft-dtype", "half", "--host", "::zz"])
    assert result.exit_code == 1
    assert "--draft-dtype must be one of" in result.output and result.output.count("\n") == 1


def test_doctor_says_which_dtype_drafts_compute_in():
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0
    line = next(line for line in result.output.splitlines() if line.startswith("draft dtype"))
    assert "the checkpoint's dtype" in line and "--draft-dtype" in line
