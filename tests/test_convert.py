"""`dflash-mlx convert`: round trips, quantized drafts, lossless generation with
quantized drafts and targets, bad input and atomic output (the installed wheel: test_packaging.py)."""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from checkpoints import write_draft, write_target
from dflash_mlx import DFlashDraft, DraftConfig, generate, load, load_draft
from dflash_mlx.cli import app
from dflash_mlx.convert import convert_draft, convert_target
from dflash_mlx.convert import writer

GROUP = 32  # divides every tiny dimension (64, 128)
# Relative L2 error of the block logits against the unquantized bf16 draft,
# group size 32, float32 activations: measured 1.3% (8-bit) and 17.6% (4-bit)
# on these random-Gaussian drafts (4-bit is ~8% error per weight).
Q8_BOUND, Q4_BOUND = 0.03, 0.30


def run_cli(*args):
    result = CliRunner().invoke(app, ["convert", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def assert_one_error(code, stderr, *words):
    lines = stderr.strip().splitlines()
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for word in words:
        assert word in lines[0], lines[0]


def assert_nothing_written(out: Path):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def block_logits(draft: DFlashDraft, seed: int = 0) -> mx.array:
    """Block logits through the draft's own API and a random tied head.

    Activations are float32, so differences come from the weights alone.
    """
    cfg, rng = draft.config, np.random.default_rng(seed)
    features = mx.array(rng.normal(0, 1, (1, 11, cfg.feature_size)), dtype=mx.float32)
    embeddings = mx.array(rng.normal(0, 0.1, (1, cfg.block_size, cfg.hidden_size)), dtype=mx.float32)
    head = mx.array(rng.normal(0, 0.1, (cfg.vocab_size, cfg.hidden_size)), dtype=mx.float32)
    cache = draft.make_cache()
    draft.inject(features, cache)
    hidden = draft(embeddings, cache)
    return hidden @ head.T


def rel_error(a: mx.array, b: mx.array) -> float:
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny qwen3 target and a bf16 sliding-window draft for it."""
    root = tmp_path_factory.mktemp("convert")
    target = write_target(root / "target", "qwen3")
    write_draft(root / "draft", target, dtype="bfloat16", num_layers=3,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                sliding_window=4)
    return root


# 1. Round trip ---------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["new", "old"])
def test_unquantized_round_trip_is_bit_identical(tmp_path, dialect):
    target = write_target(tmp_path / "target", "qwen3")
    write_draft(tmp_path / "hf", target, dialect=dialect, dtype="bfloat16", num_layers=3,
                layer_types=["sliding_attention", "full_attention", "full_attention"],
                sliding_window=4, target_layer_ids=[0, 2, 5])
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "mlx")
    assert code == 0, stderr

    hf, mlx = load_draft(str(tmp_path / "hf")), load_draft(str(tmp_path / "mlx"))
    assert mlx.config == hf.config
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert "quantization" not in config and config["dflash_config"]["target_layer_ids"] == [0, 2, 5]
    for (name, a), (_, b) in zip(tree_flatten(hf.parameters()), tree_flatten(mlx.parameters())):
        assert a.dtype == b.dtype == mx.bfloat16 and mx.array_equal(a, b), name
    assert mx.array_equal(block_logits(hf), block_logits(mlx))


def test_dtype_casts_every_tensor(models, tmp_path):
    convert_draft(str(models / "draft"), tmp_path / "f32", dtype="float32", log=print)
    hf, f32 = load_draft(str(models / "draft")), load_draft(str(tmp_path / "f32"))
    for (name, a), (_, b) in zip(tree_flatten(hf.parameters()), tree_flatten(f32.parameters())):
        assert b.dtype == mx.float32 and mx.array_equal(a.astype(mx.float32), b), name


def test_shards_are_streamed_and_indexed(models, tmp_path):
    convert_draft(str(models / "draft"), tmp_path / "out", shard_bytes=40_000, log=print)
    files = sorted(p.name for p in (tmp_path / "out").glob("model*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert mx.array_equal(block_logits(load_draft(str(models / "draft"))),
                          block_logits(load_draft(str(tmp_path / "out"))))


def test_hub_repo_ids_convert_from_the_offline_cache(models, tmp_path, monkeypatch):
    import huggingface_hub.constants

    commit = "0" * 40
    for repo_id, source in [("z-lab/Tiny-DFlash", "draft"), ("tiny/Qwen3-Tiny", "target")]:
        repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
        shutil.copytree(models / source, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, _, stderr = run_cli("z-lab/Tiny-DFlash", "--out", tmp_path / "draft", "--q-bits", 8)
    assert code == 0, stderr
    assert load_draft(str(tmp_path / "draft")).fc.bits == 8
    code, _, stderr = run_cli("--target", "tiny/Qwen3-Tiny", "--out", tmp_path / "target", "-q")
    assert code == 0, stderr
    assert json.loads((tmp_path / "target" / "config.json").read_text())["quantization"]["bits"] == 4


# 2. Quantized drafts -------------------------------------------------------


@pytest.mark.parametrize("bits, bound", [(8, Q8_BOUND), (4, Q4_BOUND)])
def test_quantized_draft_logits_within_bound(models, tmp_path, bits, bound):
    code, _, stderr = run_cli(models / "draft", "--out", tmp_path / "q", "--q-bits", bits,
                              "--q-group-size", GROUP)
    assert code == 0, stderr
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"group_size": GROUP, "bits": bits, "mode": "affine"}
    draft = load_draft(str(tmp_path / "q"))
    assert draft.fc.bits == bits and draft.layers[0].self_attn.q_proj.group_size == GROUP
    ref = block_logits(load_draft(str(models / "draft")))
    err = rel_error(block_logits(draft), ref)
    assert 0 < err < bound, f"{bits}-bit relative logits error {err:.4f}"
    on_disk = sum(p.stat().st_size for p in (tmp_path / "q").glob("*.safetensors"))
    bf16 = sum(p.stat().st_size for p in (models / "draft").glob("*.safetensors"))
    assert on_disk < bf16 * (0.6 if bits == 8 else 0.4)


def test_mixed_recipe_keeps_fc_and_last_layer_at_8_bits(models, tmp_path):
    code, _, stderr = run_cli(models / "draft", "--out", tmp_path / "mixed",
                              "--recipe", "mixed_4_8", "--q-group-size", GROUP)
    assert code == 0, stderr
    quant = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["fc"]["bits"] == 8
    assert quant["layers.2.mlp.down_proj"] == {"group_size": GROUP, "bits": 8, "mode": "affine"}
    assert "layers.0.mlp.down_proj" not in quant
    draft = load_draft(str(tmp_path / "mixed"))
    assert draft.fc.bits == 8 and draft.layers[0].mlp.down_proj.bits == 4
    assert all(m.bits == 8 for _, m in draft.layers[2].named_modules() if hasattr(m, "bits"))
    assert rel_error(block_logits(draft), block_logits(load_draft(str(models / "draft")))) < Q4_BOUND


def test_non_divisible_modules_stay_unquantized_and_are_reported(tmp_path):
    # hidden 48: q/k/v/gate/up (input 48) cannot use group 32; o (64), down (128), fc (96) can.
    fake_target = {"hidden_size": 48, "num_hidden_layers": 6, "vocab_size": 512}
    write_draft(tmp_path / "hf", fake_target, dtype="bfloat16")
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "q", "-q", "--q-group-size", 32)
    assert code == 0, stderr
    assert "kept 10 of 15 modules unquantized" in stderr and "layers.1.mlp.up_proj" in stderr
    draft = load_draft(str(tmp_path / "q"))
    assert not hasattr(draft.layers[0].self_attn.q_proj, "bits")
    assert draft.layers[0].self_attn.o_proj.bits == 4 and draft.fc.bits == 4
    ref = block_logits(load_draft(str(tmp_path / "hf")))
    assert rel_error(block_logits(draft), ref) < Q4_BOUND


# 3. Lossless with quantized drafts and targets -------------------------------


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def quantized_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    config = write_target(root / "target", request.param)
    write_draft(root / "draft", config, dtype="bfloat16", block_size=6)
    convert_target(str(root / "target"), root / "target-4bit", bits=4, group_size=GROUP)
    convert_draft(str(root / "draft"), root / "draft-4bit", bits=4, group_size=GROUP, log=print)
    return root


@pytest.mark.parametrize("draft_name, target_name", [
    ("draft-4bit", "target-4bit"), ("draft-4bit", "target"), ("draft", "target-4bit"),
])
def test_generation_is_lossless_with_quantized_models(quantized_pair, draft_name, target_name):
    model, tokenizer = load(str(quantized_pair / target_name))
    if target_name.endswith("4bit"):
        assert json.loads((quantized_pair / target_name / "config.json").read_text())["quantization"]["bits"] == 4
        assert any(hasattr(m, "bits") for _, m in model.named_modules())
    draft = load_draft(str(quantized_pair / draft_name))
    prompt = tokenizer.encode("the quick brown fox jumps over the lazy dog and")
    n = 40
    reference = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        if token in tokenizer.eos_token_ids:
            break
        reference.append(token)
    result = generate(model, draft, tokenizer, prompt, max_tokens=n)
    assert result.tokens == reference


# 4. Bad input ----------------------------------------------------------------


def test_missing_tensor(tmp_path):
    target = write_target(tmp_path / "t", "qwen3")
    write_draft(tmp_path / "hf", target, omit=("layers.1.mlp.down_proj.weight",))
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "out", "--q-bits", 4)
    assert_one_error(code, stderr, "missing tensor 'layers.1.mlp.down_proj.weight'")
    assert_nothing_written(tmp_path / "out")


def _rewrite_tensor(path: Path, name: str, value: mx.array):
    weights = mx.load(str(path / "model.safetensors"))
    weights[name] = value
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def test_wrong_shape(models, tmp_path):
    shutil.copytree(models / "draft", tmp_path / "hf")
    _rewrite_tensor(tmp_path / "hf", "layers.0.self_attn.k_proj.weight", mx.zeros((16, 64)))
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "out")
    assert_one_error(code, stderr, "'layers.0.self_attn.k_proj.weight'", "[16, 64]", "[32, 64]")
    assert_nothing_written(tmp_path / "out")


def test_fc_width_inconsistent_with_target_layer_ids(models, tmp_path):
    shutil.copytree(models / "draft", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 2]  # fc.weight was made for 3
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "out")
    assert_one_error(code, stderr, "'fc.weight'", "192", "target_layer_ids [1, 2]", "128")
    assert_nothing_written(tmp_path / "out")


def test_unexpected_tensor(models, tmp_path):
    shutil.copytree(models / "draft", tmp_path / "hf")
    _rewrite_tensor(tmp_path / "hf", "layers.3.mlp.up_proj.weight", mx.zeros((128, 64)))
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "out")
    assert_one_error(code, stderr, "unexpected tensor 'layers.3.mlp.up_proj.weight'")
    assert_nothing_written(tmp_path / "out")


def test_invalid_json(models, tmp_path):
    shutil.copytree(models / "draft", tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text('{"hidden_size": 64,')
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "out")
    assert_one_error(code, stderr, "not valid JSON")
    assert_nothing_written(tmp_path / "out")


def test_truncated_weights(models, tmp_path):
    shutil.copytree(models / "draft", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    code, _, stderr = run_cli(tmp_path / "hf", "--out", tmp_path / "out", "-q")
    assert_one_error(code, stderr, "model.safetensors")
    assert_nothing_written(tmp_path / "out")


def test_group_size_dividing_no_module(tmp_path):
    # hidden 40, 2 heads of 20, intermediate 48, fc 80: no input width divides 32.
    config = {
        "model_type": "qwen3", "hidden_size": 40, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 20,
        "intermediate_size": 48, "vocab_size": 100, "num_target_layers": 4,
        "dflash_config": {"block_size": 4, "mask_token_id": 99, "target_layer_ids": [1, 2]},
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config))
    weights = tree_flatten(DFlashDraft(DraftConfig.from_dict(config)).parameters())
    mx.save_safetensors(str(hf / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights})
    code, _, stderr = run_cli(hf, "--out", tmp_path / "out", "--q-bits", 4, "--q-group-size", 32)
    assert_one_error(code, stderr, "--q-group-size 32", "nothing would be quantized")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("what", ["draft", "target"])
def test_existing_output_needs_force_and_must_be_ours(models, tmp_path, what):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    src = ["--target", models / "target"] if what == "target" else [models / "draft"]
    args = [*src, "--out", out, "-q", "--q-group-size", GROUP]
    code, _, stderr = run_cli(*args)
    assert_one_error(code, stderr, "already exists", "--force")
    code, _, stderr = run_cli(*args, "--force")
    assert_one_error(code, stderr, "not a dflash-mlx output")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    shutil.rmtree(out)
    assert run_cli(*args)[0] == 0
    (out / "keep.txt").write_text("stale")
    code, _, stderr = run_cli(*args, "--force")  # our own earlier output
    assert code == 0, stderr
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


@pytest.mark.parametrize("args, words", [
    (["--q-bits", 3], ["--q-bits", "4 or 8"]),
    (["--q-group-size", 48], ["--q-group-size"]),
    (["--dtype", "int8"], ["--dtype"]),
    (["--recipe", "mixed_2_6"], ["mixed_2_6"]),
    (["--recipe", "mixed_4_8", "--q-bits", 8], ["mixed_4_8"]),
])
def test_bad_options(models, tmp_path, args, words):
    code, _, stderr = run_cli(models / "draft", "--out", tmp_path / "out", *args)
    assert_one_error(code, stderr, *words)
    assert_nothing_written(tmp_path / "out")


def test_draft_and_target_are_exclusive(models, tmp_path):
    code, _, stderr = run_cli(models / "draft", "--target", models / "target", "--out", tmp_path / "out")
    assert_one_error(code, stderr, "SRC", "--target")
    code, _, stderr = run_cli("--out", tmp_path / "out")
    assert_one_error(code, stderr, "SRC", "--target")
    assert_nothing_written(tmp_path / "out")


def test_interrupted_conversion_leaves_no_output(models, tmp_path, monkeypatch):
    calls, save = [], mx.save_safetensors

    def interrupted_save(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return save(*args, **kwargs)

    monkeypatch.setattr(writer.mx, "save_safetensors", interrupted_save, raising=True)
    with pytest.raises(KeyboardInterrupt):
        convert_draft(str(models / "draft"), tmp_path / "out", bits=4, group_size=GROUP,
                      shard_bytes=20_000, log=print)
    assert len(calls) == 2
    assert_nothing_written(tmp_path / "out")
