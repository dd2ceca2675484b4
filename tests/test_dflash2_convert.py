"""Converting and quantizing DFlash2 drafts: z-lab's layout in, ours out (the
two codebooks renamed), 8 and 4 bits with the codebooks quantized too; the
result loads, stays lossless, and at 8 bits proposes what the float draft
proposes."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from checkpoints import write_dflash2_draft
from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.convert import convert_draft
from dflash_mlx.loop.decoder import DFlash2Proposer
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams

BLOCK, GROUP = 8, 32


@pytest.fixture(scope="module")
def source(tmp_path_factory, target_dirs):
    """A qwen3_5 target and a DFlash2 draft for it in z-lab's layout (rank 64,
    so the codebooks' rows split into quantization groups)."""
    config = json.loads((target_dirs["qwen3_5"] / "config.json").read_text())
    path = tmp_path_factory.mktemp("dflash2-source")
    write_dflash2_draft(path, config, block_size=BLOCK, rank=64, layer_types=["sliding_attention"] * 2,
                        sliding_window=16)
    return target_dirs["qwen3_5"], path


def test_converted_draft_is_ours_and_equal(tmp_path, source):
    _, src = source
    out = convert_draft(str(src), tmp_path / "out", log=print)
    names = set(mx.load(str(next(out.glob("model*.safetensors")))).keys())
    assert "candidate_selector.successor_codebook.weight" in names
    assert "candidate_selector.successor_codebook" not in names
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    original, converted = load_draft(str(src)), load_draft(str(out))
    assert original.config == converted.config
    for (name, a), (_, b) in zip(tree_flatten(original.parameters()), tree_flatten(converted.parameters())):
        assert mx.array_equal(a, b).item(), name


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_draft_quantizes_the_codebooks_and_stays_lossless(tmp_path, source, bits):
    target_dir, src = source
    out = convert_draft(str(src), tmp_path / f"q{bits}", bits=bits, group_size=GROUP, log=print)
    draft = load_draft(str(out))
    selector = draft.candidate_selector
    assert isinstance(selector.predecessor_codebook, nn.QuantizedEmbedding)
    assert isinstance(selector.successor_codebook, nn.QuantizedEmbedding)
    assert selector.successor_codebook.bits == bits
    assert isinstance(draft.layers[0].attention_conv.kernel_projection, nn.QuantizedLinear)
    model, tokenizer = mlx_lm_load(str(target_dir))
    ids = tokenizer.encode("the quick brown fox")
    want = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=24)]
    assert generate(model, draft, tokenizer, ids, max_tokens=24, block_size=BLOCK).tokens == want
    tokens = generate(model, draft, tokenizer, ids, max_tokens=24, block_size=BLOCK, temperature=1.0, seed=3).tokens
    assert len(tokens) == 24 and all(0 <= t < draft.config.vocab_size for t in tokens)


def test_eight_bits_keep_the_float_drafts_proposals(tmp_path, source):
    """Quantizing keeps acceptance: on the same contexts the 8-bit draft's
    logits stay close to the float draft's and its greedy walk starts with the
    same token (later rows follow the first, so one near-tie changes the rest)."""
    target_dir, src = source
    quantized = load_draft(str(convert_draft(str(src), tmp_path / "q8", bits=8, group_size=GROUP, log=print)))
    original = load_draft(str(src))
    target = Target(mlx_lm_load(str(target_dir))[0])
    greedy = BlockSampler(SamplingParams())
    first = []
    for seed in range(8):
        features = mx.random.normal((1, 20, len(original.config.target_layer_ids) * target.hidden_size),
                                    key=mx.random.key(seed))
        y = mx.array([10 + seed])
        logits, paths = [], []
        for draft in (original, quantized):
            proposer = DFlash2Proposer(draft, target)
            proposer.observe(features, None)
            logits.append(proposer.propose(y, BLOCK).astype(mx.float32))
            paths.append(proposer.draft_block(y, BLOCK, greedy)[0].tolist())
        error = mx.abs(logits[0] - logits[1]).max() / mx.abs(logits[0]).max()
        assert error.item() < 0.08, f"8-bit logits off by {error.item():.1%}"
        first.append(paths[0][0] == paths[1][0])
    assert sum(first) >= 7, f"the 8-bit walk's first token agrees in {sum(first)} of 8 contexts"


def test_a_v1_checkpoint_with_dflash2_tensors_is_refused(tmp_path, source):
    _, src = source
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["DFlashDraftModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="unexpected tensor"):
        convert_draft(str(bad), tmp_path / "out", log=print)


def test_the_published_shapes_are_what_the_network_expects():
    """The Qwen3.8-27B-DFlash2 dimensions (H 5120, 32 query and 8 KV heads of
    128, MLP 17408, K 2, gs 16, R 256, V 248320): the converter's expected
    tensors have the published shapes (nothing is materialised)."""
    from dflash_mlx.convert.checkpoint import expected_shapes
    from dflash_mlx.draft import DFlash2Config

    config = DFlash2Config.from_dict({
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 5120,
        "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 17408, "vocab_size": 248320, "num_target_layers": 64, "is_causal": False,
        "layer_types": ["sliding_attention"] * 2, "sliding_window": 2048,
        "dflash_config": {"block_size": 8, "mask_token_id": 248077, "target_layer_ids": [1, 62],
                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 8},
    })
    shapes = expected_shapes(config)
    assert shapes["layers.1.attention_conv.kernel_projection.weight"] == (1280, 5120)
    assert shapes["layers.0.mlp_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)
    assert shapes["candidate_selector.predecessor_codebook.weight"] == (248320, 256)
    assert shapes["candidate_selector.successor_codebook.weight"] == (248320, 256)
    assert shapes["fc.weight"] == (5120, 2 * 5120) and config.block_size == 8
