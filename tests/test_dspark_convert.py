"""Converting and quantizing DSpark drafts: each published packaging (DeepSpec's,
LiquidAI's, the speculators format) converts to an MLX draft in DeepSpec's
layout that loads with the same weights and greedy output; 8 and 4 bits
quantize the backbone and keep the Markov and confidence heads float unless
asked (``convert --quantize-heads``, refused where it would do nothing); the
8-bit draft stays token-identical to mlx-lm's greedy output."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from typer.testing import CliRunner

from dflash_mlx import generate, load_draft
from dflash_mlx.cli import app
from dflash_mlx.convert import convert_draft
from test_cli_ignored import refused
from test_dspark import greedy_reference, write_dspark_draft
from test_dspark_packaging import write_liquid, write_speculators

# interleaved RoPE (LiquidAI's): the draft's KV injection runs layer by layer, and says so once
pytestmark = pytest.mark.filterwarnings("ignore:dflash-mlx. KV injection runs layer by layer")

GROUP, RANK, TOKENS = 32, 32, 24  # rank 32: the heads' tables split into groups, so they could quantize


@pytest.fixture(scope="module")
def sources(tmp_path_factory, target_dirs):
    """(mlx-lm model, tokenizer, {packaging: draft directory}) for the qwen3 target."""
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    config = json.loads((target_dirs["qwen3"] / "config.json").read_text())
    root = tmp_path_factory.mktemp("dspark-sources")
    (root / "deepspec").mkdir()
    write_dspark_draft(root / "deepspec", model, config, rank=RANK)
    write_liquid(root / "deepspec", root / "liquid")
    write_speculators(root / "deepspec", root / "speculators", list(range(0, 500, 2)))
    return model, tokenizer, {name: root / name for name in ("deepspec", "liquid", "speculators")}


def drafted(model, tokenizer, draft):
    ids = tokenizer.encode("the quick brown fox")
    return generate(model, draft, tokenizer, ids, max_tokens=TOKENS).tokens


@pytest.mark.parametrize("layout", ["deepspec", "liquid", "speculators"])
def test_each_packaging_converts_to_the_same_draft(tmp_path, sources, layout):
    model, tokenizer, paths = sources
    out = convert_draft(str(paths[layout]), tmp_path / "out", log=print)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    original, converted = load_draft(str(paths[layout])), load_draft(str(out))
    assert original.config == converted.config
    mine, theirs = dict(tree_flatten(original.parameters())), dict(tree_flatten(converted.parameters()))
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert mine[name].dtype == theirs[name].dtype and mx.array_equal(mine[name], theirs[name]).item(), name
    assert drafted(model, tokenizer, converted) == drafted(model, tokenizer, original)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizing_keeps_the_heads_float_and_stays_lossless(tmp_path, sources, bits):
    model, tokenizer, paths = sources
    draft = load_draft(str(convert_draft(str(paths["speculators"]), tmp_path / f"q{bits}", bits=bits,
                                         group_size=GROUP, log=print)))
    assert isinstance(draft.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert draft.layers[0].self_attn.q_proj.bits == bits
    assert type(draft.markov_head.markov_w1) is nn.Embedding
    assert type(draft.markov_head.markov_w2) is nn.Linear
    assert type(draft.confidence_head.proj) is nn.Linear
    assert draft.d2t.dtype == mx.int64
    ids = tokenizer.encode("the quick brown fox")
    assert drafted(model, tokenizer, draft) == greedy_reference(model, ids, TOKENS)


def test_the_heads_quantize_when_asked(tmp_path, sources):
    model, tokenizer, paths = sources
    draft = load_draft(str(convert_draft(str(paths["deepspec"]), tmp_path / "q8", bits=8, group_size=GROUP,
                                         quantize_heads=True, log=print)))
    assert isinstance(draft.markov_head.markov_w1, nn.QuantizedEmbedding)
    assert isinstance(draft.markov_head.markov_w2, nn.QuantizedLinear)
    ids = tokenizer.encode("the quick brown fox")
    assert drafted(model, tokenizer, draft) == greedy_reference(model, ids, TOKENS)


def test_the_command_line_quantizes_the_heads_when_asked(tmp_path, sources):
    """``dflash-mlx convert --quantize-heads``: the output's Markov and
    confidence heads carry quantization scales, and the draft still decodes
    token-identically to mlx-lm's greedy output."""
    model, tokenizer, paths = sources
    out = tmp_path / "q8-heads"
    done = CliRunner().invoke(app, ["convert", str(paths["deepspec"]), "--out", str(out), "--q-bits", "8",
                                    "--q-group-size", str(GROUP), "--quantize-heads"])
    assert done.exit_code == 0, done.output
    stored = {name for file in out.glob("*.safetensors") for name in mx.load(str(file))}
    for head in ("markov_head.markov_w1", "markov_head.markov_w2", "confidence_head.proj"):
        assert f"{head}.scales" in stored, head
    draft = load_draft(str(out))
    assert isinstance(draft.markov_head.markov_w2, nn.QuantizedLinear)
    ids = tokenizer.encode("the quick brown fox")
    assert drafted(model, tokenizer, draft) == greedy_reference(model, ids, TOKENS)


def test_the_heads_stay_float_without_the_flag(tmp_path, sources):
    _, _, paths = sources
    out = tmp_path / "q8"
    done = CliRunner().invoke(app, ["convert", str(paths["deepspec"]), "--out", str(out), "--q-bits", "8",
                                    "--q-group-size", str(GROUP)])
    assert done.exit_code == 0, done.output
    stored = {name for file in out.glob("*.safetensors") for name in mx.load(str(file))}
    assert "markov_head.markov_w2.weight" in stored and "markov_head.markov_w2.scales" not in stored


@pytest.mark.parametrize("extra, wanted", [
    ([], "--quantize-heads does nothing without --quantize, --q-bits or --recipe"),
    (["-q"], "--quantize-heads applies to a DSpark draft's Markov and confidence heads"),
])
def test_the_command_line_refuses_quantize_heads_where_there_are_none(tmp_path, draft_dir, extra, wanted):
    refused(["convert", draft_dir("qwen3"), "--out", tmp_path / "out", "--quantize-heads", *extra], wanted)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_quantize_heads_for_a_target(tmp_path):
    refused(["convert", "--target", tmp_path / "nowhere", "--out", tmp_path / "out", "-q", "--quantize-heads"],
            "--quantize-heads does nothing without a draft SRC")
