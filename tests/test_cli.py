"""`dflash-mlx generate` end to end on a tiny pair from disk, and every bad
input answered with one `error:` line and a non-zero exit."""

import json
import shutil
import subprocess

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from checkpoints import text_config, write_draft
from dflash_mlx.cli import app

runner = CliRunner()


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def assert_one_error_line(result, *fragments):
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    return target_dirs["qwen3"], draft_dir("qwen3")


def test_generate_streams_the_targets_greedy_text(pair):
    target, draft = pair
    result = run("generate", "--model", target, "--draft", draft, "--prompt", "the quick brown fox",
                 "--max-tokens", 24, "--no-chat-template", "--block-size", 4)
    assert result.exit_code == 0, result.stderr
    model, tokenizer = mlx_lm_load(str(target))
    ids = mx.array(tokenizer.encode("the quick brown fox"))
    want = [t for t, _ in generate_step(ids, model, max_tokens=24)]
    assert result.stdout.strip() == tokenizer.decode(want).strip()
    assert "tau" in result.stderr and "tok/s" in result.stderr and "peak memory" in result.stderr


def test_generate_applies_the_chat_template_and_reads_stdin(pair):
    target, draft = pair
    result = run("generate", "-m", target, "-d", draft, "-p", "-", "-n", 8, "--system", "be brief",
                 input="hello world")
    assert result.exit_code == 0, result.stderr
    model, tokenizer = mlx_lm_load(str(target))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = mx.array(tokenizer.encode(chat, add_special_tokens=False))
    want = [t for t, _ in generate_step(ids, model, max_tokens=8)]
    assert result.stdout.strip() == tokenizer.decode(want).strip()


def test_system_message_without_a_chat_template_is_joined_as_the_server_joins_it(pair, tmp_path):
    from dflash_mlx.server.prompts import chat_ids
    from dflash_mlx.server.schemas import ChatRequest

    target, draft = pair
    untemplated = tmp_path / "target"
    shutil.copytree(target, untemplated)
    config = json.loads((untemplated / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (untemplated / "tokenizer_config.json").write_text(json.dumps(config))
    model, tokenizer = mlx_lm_load(str(untemplated))
    assert not tokenizer.has_chat_template
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = chat_ids(tokenizer, ChatRequest(model="m", messages=messages), None)  # what the server runs
    want = tokenizer.decode([t for t, _ in generate_step(mx.array(ids), model, max_tokens=8)])
    dropped = [t for t, _ in generate_step(mx.array(tokenizer.encode("hello world")), model, max_tokens=8)]
    assert tokenizer.decode(dropped) != want  # without the system message the output differs
    result = run("generate", "-m", untemplated, "-d", draft, "-p", "hello world", "-n", 8, "--system", "be brief")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == want.strip()
    assert "chat template" not in result.stderr


def test_seeded_sampling_is_reproducible(pair):
    target, draft = pair
    args = ["generate", "-m", target, "-d", draft, "-p", "hello", "-n", 16, "--temp", 0.8, "--top-k", 20]
    first, second = run(*args, "--seed", 3), run(*args, "--seed", 3)
    assert first.exit_code == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_models_lists_the_registry():
    result = run("models")
    assert result.exit_code == 0
    assert "Qwen/Qwen3.5-9B" in result.stdout and "z-lab/Qwen3.5-9B-DFlash" in result.stdout


def _mismatched_draft(tmp_path, target, **change):
    config = json.loads((target / "config.json").read_text())
    text = text_config(config)
    layer_ids = change.pop("target_layer_ids", None)
    write_draft(tmp_path / "draft", {**text, **change}, target_layer_ids=layer_ids)
    return tmp_path / "draft"


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"hidden_size": 32}, "hidden_size 32"),
        ({"vocab_size": 256}, "vocab_size 256"),
        ({"num_hidden_layers": 8}, "num_target_layers 8"),
        ({"target_layer_ids": [1, 6]}, "target_layer_ids [6]"),
    ],
)
def test_draft_made_for_another_target(pair, tmp_path, change, fragment):
    target, _ = pair
    draft = _mismatched_draft(tmp_path, target, **change)
    assert_one_error_line(run("generate", "-m", target, "-d", draft, "-p", "hi"), fragment)


def test_missing_tensor_is_named(pair, draft_dir):
    target, _ = pair
    missing = draft_dir("qwen3", omit=("layers.1.mlp.up_proj.weight",))
    assert_one_error_line(run("generate", "-m", target, "-d", missing, "-p", "hi"), "layers.1.mlp.up_proj.weight")


def test_missing_and_corrupt_files(pair, tmp_path):
    target, draft = pair
    broken = tmp_path / "broken"
    shutil.copytree(draft, broken)
    (broken / "model.safetensors").unlink()
    assert_one_error_line(run("generate", "-m", target, "-d", broken, "-p", "hi"), "model*.safetensors")

    shutil.copy(draft / "model.safetensors", broken / "model.safetensors")
    (broken / "config.json").write_text("{not json")
    assert_one_error_line(run("generate", "-m", target, "-d", broken, "-p", "hi"), "not valid JSON")

    shutil.copy(draft / "config.json", broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    assert_one_error_line(run("generate", "-m", target, "-d", broken, "-p", "hi"), "cannot load draft")

    shutil.copy(draft / "model.safetensors", broken / "model.safetensors")
    weights = mx.load(str(broken / "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, :64]
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    assert_one_error_line(run("generate", "-m", target, "-d", broken, "-p", "hi"), "fc.weight", "(64, 64)")

    assert_one_error_line(run("generate", "-m", tmp_path / "nowhere", "-d", draft, "-p", "hi"), "nowhere")
    no_weights = tmp_path / "target"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((target / "config.json").read_text())
    assert_one_error_line(run("generate", "-m", no_weights, "-d", draft, "-p", "hi"), "cannot load target")


def test_offline_repo_suggests_a_local_path(pair):
    target, _ = pair
    result = run("generate", "-m", target, "-d", "z-lab/Not-Cached-DFlash", "-p", "hi")
    assert_one_error_line(result, "z-lab/Not-Cached-DFlash", "local directory")


def test_unknown_target_without_draft_lists_known_targets(pair):
    target, _ = pair
    assert_one_error_line(run("generate", "-m", target, "-p", "hi"), "--draft", "Qwen/Qwen3.5-9B")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["-p", ""], "prompt is empty"),
        (["-p", "-"], "prompt is empty"),
        (["-p", "hi", "-n", "0"], "--max-tokens must be positive"),
        (["-p", "hi", "-n", "-3"], "--max-tokens must be positive"),
        (["-p", "hi", "-b", "1"], "--block-size must be at least 2"),
        (["-p", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["-p", "hi", "--temp", "-1"], "--temp must be >= 0"),
        (["-p", "hi", "--top-p", "nan"], "--top-p must be a finite number"),
        (["-p", "hi", "--min-p", "2"], "--min-p must be in [0, 1], got 2"),
        (["-p", "hi", "--top-k", "-1"], "--top-k must be >= 0"),
        (["-p", "hi", "--prefill-step-size", "0"], "--prefill-step-size must be positive"),
        (["-p", "hi", "-b", "17"], "--block-size must be at most 16"),
        (["-p", "hi", "-b", "x"], "Invalid value for '--block-size'"),
        (["-p", " \n"], "prompt is empty"),
        (["-p", "hi", "--system", "be brief", "--no-chat-template"], "--system goes through the chat template"),
    ],
)
def test_bad_arguments(pair, args, fragment):
    target, draft = pair
    assert_one_error_line(run("generate", "-m", target, "-d", draft, *args, input=""), fragment)


def test_installed_console_script_exits_non_zero(pair):
    """The real entry point, not just the typer app, gives one line and exit 1."""
    target, draft = pair
    exe = shutil.which("dflash-mlx") or pytest.skip("console script not on PATH")
    proc = subprocess.run([exe, "generate", "-m", target, "-d", draft, "-p", "hi", "-n", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: --max-tokens must be positive, got 0"


@pytest.mark.parametrize(
    "target, draft",
    [
        ("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
        ("mlx-community/Qwen3.5-9B-4bit", "z-lab/Qwen3.5-9B-DFlash"),
        ("mlx-community/Qwen3.5-35B-A3B-8bit", "z-lab/Qwen3.5-35B-A3B-DFlash"),
        ("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
        ("/models/Qwen3-8B-4bit", "z-lab/Qwen3-8B-DFlash-b16"),
        ("mlx-community/gpt-oss-20b-MXFP4-Q8", "z-lab/gpt-oss-20b-DFlash"),
        ("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash"),
        ("Qwen/Qwen3.5-9B-Base", None),
        ("someone/unknown", None),
    ],
)
def test_registry_maps_quantized_targets_to_the_base_draft(target, draft):
    from dflash_mlx.registry import find_draft

    assert find_draft(target) == draft


def _cache_as_hub_repo(cache, repo_id, source):
    """Lay a directory out as huggingface_hub's cache holds a downloaded repo."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_repo_ids_resolve_through_huggingface_hub(pair, tmp_path, monkeypatch):
    import huggingface_hub.constants

    target, draft = pair
    _cache_as_hub_repo(tmp_path, "tiny/Qwen3-Tiny", target)
    _cache_as_hub_repo(tmp_path, "z-lab/Qwen3-Tiny-DFlash", draft)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    result = run("generate", "-m", "tiny/Qwen3-Tiny", "-d", "z-lab/Qwen3-Tiny-DFlash",
                 "-p", "hello", "-n", 5, "--no-chat-template")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()


def test_block_above_the_trained_size_warns_once_and_stays_lossless(pair):
    target, draft = pair  # trained at block 8
    result = run("generate", "-m", target, "-d", draft, "-p", "the quick brown fox", "-n", 16,
                 "--no-chat-template", "-b", 12)
    assert result.exit_code == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "warn" in line.lower()] == [
        "warning: --block-size 12 is above the draft's trained block size 8: "
        "acceptance at draft positions beyond 8 is untrained"]
    model, tokenizer = mlx_lm_load(str(target))
    want = [t for t, _ in generate_step(mx.array(tokenizer.encode("the quick brown fox")), model, max_tokens=16)]
    assert result.stdout.strip() == tokenizer.decode(want).strip()


def test_generate_stops_before_a_stop_string(pair):
    """--stop ends the output where the target's greedy text reaches it, the
    stop string itself not printed."""
    target, draft = pair
    model, tokenizer = mlx_lm_load(str(target))
    ids = mx.array(tokenizer.encode("the quick brown fox"))
    text = tokenizer.decode([t for t, _ in generate_step(ids, model, max_tokens=24)])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    result = run("generate", "-m", target, "-d", draft, "-p", "the quick brown fox", "-n", 24,
                 "--no-chat-template", "--stop", "never in the output", "--stop", stop)
    assert result.exit_code == 0, result.stderr
    # (the streaming detokenizer drops the first token's leading space, as the first test allows)
    assert result.stdout.lstrip() == text[: text.index(stop)].lstrip() + "\n"
    assert "stopped at a --stop string" in result.stderr
