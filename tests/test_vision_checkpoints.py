"""Checkpoints that carry a vision tower: text-only prompts run the text model
as before (docs/targets.md, "Vision-carrying checkpoints"); prompts with
images run the prefill over the tower's features and equal mlx-vlm's own
logits and greedy generation (docs/vision.md). The tiny multimodal
checkpoints are built with mlx-vlm's own classes and saved as mlx-vlm saves
them (the layout of the mlx-community conversions)."""

import copy
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import VISION_AND_MTP_TENSORS, _init_weights, _target_config, write_draft, write_vision_carrying_target
from mlx.utils import tree_flatten
from test_loop import greedy_reference

from dflash_mlx import generate, load, load_draft

# the tiny vision checkpoint's special tokens: the last ids below <mask>'s BPE, as Qwen's
VISION_TOKENS = {"<|vision_start|>": "vision_start_token_id", "<|image_pad|>": "image_token_id",
                 "<|vision_end|>": "vision_end_token_id"}
VISION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_qwen_vision_target(path: Path, seed: int = 0, family: str = "qwen3_5") -> dict:
    """A tiny Qwen3.5 multimodal checkpoint: mlx-vlm's model with random
    weights, saved by mlx-vlm, with a tokenizer holding Qwen's vision tokens,
    a chat template that writes image parts as Qwen's does, and the image
    processor's settings. Returns the config."""
    pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")
    from mlx_vlm.models import qwen3_5, qwen3_5_moe
    from mlx_vlm.utils import save_config, save_weights
    from tokenizers import Tokenizer

    from checkpoints import write_tokenizer

    config = _target_config(family, {})
    text = config["text_config"]
    text["rope_parameters"].update(mrope_section=[2, 1, 1], partial_rotary_factor=0.5)  # 4 rotary pairs
    config["vision_config"] = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                               "out_hidden_size": text["hidden_size"], "patch_size": 4, "spatial_merge_size": 2,
                               "temporal_patch_size": 2, "num_position_embeddings": 16, "in_channels": 3}
    vocab = text["vocab_size"]
    ids = {name: vocab - 4 + i for i, name in enumerate(VISION_TOKENS)}  # below <mask>
    config.update({key: ids[name] for name, key in VISION_TOKENS.items()}, video_token_id=vocab - 5)
    arch = qwen3_5 if family == "qwen3_5" else qwen3_5_moe
    model = arch.Model(arch.ModelConfig.from_dict(copy.deepcopy(config)))
    _init_weights(model, seed)
    path = Path(path)
    save_weights(path, model)
    save_config(copy.deepcopy(config), path / "config.json")
    write_tokenizer(path, vocab - 4)  # then the three vision tokens, then <mask> again as the last id
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(list(VISION_TOKENS) + ["<mask_last>"])
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = VISION_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    preprocessor = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
                    "size": {"shortest_edge": 16 * 16, "longest_edge": 32 * 32},
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return config


def picture(seed: int, size=(20, 28)) -> "PIL.Image.Image":  # noqa: F821
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).uniform(0, 255, (*size, 3)).astype(np.uint8))


def vision_pair(path: Path, family: str) -> tuple[Path, Path]:
    """(target dir, draft dir) of a tiny ``family`` multimodal pair under ``path``."""
    config = write_qwen_vision_target(path / "target", family=family)
    write_draft(path / "draft", config, block_size=8)
    return path / "target", path / "draft"


@pytest.fixture(scope="module")
def qwen_vision(tmp_path_factory):
    """The tiny Qwen3.5 multimodal pair."""
    return vision_pair(tmp_path_factory.mktemp("qwen-vision"), "qwen3_5")


@pytest.fixture(scope="module")
def qwen_moe_vision(tmp_path_factory):
    """The tiny Qwen3.5-MoE multimodal pair (mlx-vlm's ``qwen3_5_moe``)."""
    return vision_pair(tmp_path_factory.mktemp("qwen-moe-vision"), "qwen3_5_moe")


def test_a_vision_carrying_qwen3_5_checkpoint_loads_and_generates_text_only(tmp_path, target_dirs, draft_dir):
    write_vision_carrying_target(tmp_path / "target", "qwen3_5")
    on_disk = {k for f in (tmp_path / "target").glob("*.safetensors") for k in mx.load(str(f))}
    assert set(VISION_AND_MTP_TENSORS) <= on_disk
    model, tokenizer = load(str(tmp_path / "target"))
    plain, _ = load(str(target_dirs["qwen3_5"]))
    names = dict(tree_flatten(model.parameters()))
    assert names.keys() == dict(tree_flatten(plain.parameters())).keys()
    assert not any("vision" in n or "visual" in n or "mtp" in n for n in names)

    prompt = "the quick brown fox"
    want = greedy_reference(plain, tokenizer.encode(prompt), 24)
    res = generate(model, load_draft(str(draft_dir("qwen3_5"))), tokenizer, prompt, max_tokens=24, block_size=4)
    assert res.tokens == want


def image_messages(text: str, images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


def vlm_inputs(target_dir: Path, expanded: mx.array, images: list):
    """mlx-vlm's own model of the checkpoint and its keyword inputs for ``images``."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, _qwen_vl_image_kwargs
    from mlx_vlm.utils import load_model

    out = Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(str(target_dir)))(images)
    return load_model(target_dir), dict(pixel_values=mx.array(out["pixel_values"]),
                                        image_grid_thw=mx.array(out["image_grid_thw"]))


def test_an_image_prompt_prefills_to_mlx_vlm_s_logits_and_drafts_at_every_acceptance_length(qwen_vision):
    from mlx_vlm.generate.ar import generate_step

    from dflash_mlx.chat import template_ids
    from dflash_mlx.targets import Target
    from dflash_mlx.vision import with_images

    target_dir, _ = qwen_vision
    model, tokenizer = load(str(target_dir))
    ids = mx.array(template_ids(tokenizer, image_messages("what is this", 2)))
    images = [picture(1), picture(2, (36, 20))]
    target, expanded, digests = with_images(Target(model), ids, images)
    assert expanded.size > ids.size and len(set(digests)) == 2
    assert target.stack.prompt.delta < 0  # the text after the images sits at earlier RoPE positions

    vlm, inputs = vlm_inputs(target_dir, expanded, images)
    theirs = vlm(expanded[None], **inputs).logits
    ours = target.logits(target.forward(expanded[None], target.make_cache(), [1]).hidden)
    assert mx.abs(ours - theirs).max().item() < 1e-4 * mx.abs(theirs).max().item() + 1e-3

    block = 4
    want = [int(t) for t, _ in generate_step(expanded[None], vlm, inputs.pop("pixel_values"), None,
                                             max_tokens=3 * block + 2, temperature=0.0, **inputs)]
    assert_every_acceptance_length(target, expanded, want, block)


def assert_every_acceptance_length(target, expanded: mx.array, want: list[int], block: int) -> None:
    """With an oracle draft of ``want`` wrong at each index in turn (and right
    throughout), prefilled in chunks of 5, two cycles accept exactly that many
    and stay on ``want`` (3 * block + 2 tokens)."""
    from test_loop import OracleProposer

    from dflash_mlx.loop import SpeculativeDecoder

    for corrupt_at in [*range(block - 1), None]:
        oracle = OracleProposer(expanded.size, want, corrupt_at, target.vocab_size)
        decoder = SpeculativeDecoder(target, oracle, [1], block, prefill_step_size=5)
        out = [decoder.prefill(expanded)]
        for _ in range(2):
            cycle = decoder.cycle()
            assert cycle.accepted == (block - 1 if corrupt_at is None else corrupt_at)
            out += cycle.tokens
        assert out == want[: len(out)]


@pytest.mark.parametrize("pair, block_size", [("qwen_vision", 2), ("qwen_vision", 8), ("qwen_moe_vision", 4)])
def test_dflash_with_an_image_equals_mlx_vlm_s_greedy_generation(request, pair, block_size):
    from mlx_vlm.generate.ar import generate_step

    from dflash_mlx.chat import template_ids
    from dflash_mlx.targets import Target
    from dflash_mlx.vision import with_images

    target_dir, draft_path = request.getfixturevalue(pair)
    model, tokenizer = load(str(target_dir))
    ids = template_ids(tokenizer, image_messages("describe it", 1))
    _, expanded, _ = with_images(Target(model), mx.array(ids), [picture(3)])
    vlm, inputs = vlm_inputs(target_dir, expanded, [picture(3)])
    want = [int(t) for t, _ in generate_step(expanded[None], vlm, inputs.pop("pixel_values"), None,
                                             max_tokens=24, temperature=0.0, **inputs)]
    draft = load_draft(str(draft_path))
    got = generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size, images=[picture(3)])
    assert got.tokens == want[: len(got.tokens)] and (len(got.tokens) == 24 or got.finish_reason == "stop")
    other = generate(model, draft, tokenizer, ids, max_tokens=24, block_size=block_size, images=[picture(4)])
    assert other.tokens != got.tokens


def test_an_image_is_refused_in_one_line_without_a_vision_tower(qwen_vision, target_dirs, draft_dir, tmp_path):
    from dflash_mlx import DFlashError

    for family, path in (("llama", target_dirs["llama"]), ("qwen3_5", target_dirs["qwen3_5"])):
        model, tokenizer = load(str(path))
        with pytest.raises(DFlashError) as e:
            generate(model, load_draft(str(draft_dir(family))), tokenizer, "hi", max_tokens=2, images=[picture(1)])
        assert "\n" not in str(e.value)
        assert ("takes no images" if family == "llama" else "has no vision tower") in str(e.value)
    model, tokenizer = load(str(qwen_vision[0]))
    with pytest.raises(DFlashError, match="0 image placeholder"):
        generate(model, load_draft(str(qwen_vision[1])), tokenizer, "hi", max_tokens=2, images=[picture(1)])
    (tmp_path / "x.png").write_bytes(b"not a png")
    with pytest.raises(DFlashError, match="not an image"):
        generate(model, load_draft(str(qwen_vision[1])), tokenizer, template_ids_for(tokenizer), max_tokens=2,
                 images=[str(tmp_path / "x.png")])


def template_ids_for(tokenizer, text: str = "hi") -> list[int]:
    from dflash_mlx.chat import template_ids

    return template_ids(tokenizer, image_messages(text, 1))


def test_generate_image_on_the_command_line_equals_the_python_api(qwen_vision, tmp_path):
    from cli_run import cli, one_error_line

    target_dir, draft_path = qwen_vision
    picture(5).save(tmp_path / "p.png")
    model, tokenizer = load(str(target_dir))
    want = generate(model, load_draft(str(draft_path)), tokenizer, template_ids_for(tokenizer, "what is this"),
                    max_tokens=12, block_size=4, images=[str(tmp_path / "p.png")])
    pair = ["generate", "--model", target_dir, "--draft", draft_path, "-n", 12, "-b", 4]
    out = cli(*pair, "--image", tmp_path / "p.png", "--prompt", "what is this")
    assert out.returncode == 0 and out.stdout.strip() == want.text.strip(), out.stderr
    one_error_line(cli(*pair, "--image", tmp_path / "none.png", "--prompt", "x"), "none.png")


def test_a_pass_running_past_the_prompt_gets_image_features_only_at_image_rows():
    """A pass from inside the prompt on past its end (more rows than the
    prompt has left) takes each image row's features and keeps every other
    row, those past the prompt included; its positions run on after the prompt's."""
    from dflash_mlx.vision.target import ImagePrompt

    features = mx.array([[10.0, 10.0], [20.0, 20.0]])
    prompt = ImagePrompt(features, rows=[-1, 0, 1, -1], positions=mx.array([[0, 1, 1, 2]] * 3), delta=-1)
    h = mx.zeros((1, 6, 2))
    merged = prompt.merge(h, 1)  # indices 1..6: two image rows, one text row, three past the prompt
    assert merged.tolist()[0] == [[10.0, 10.0], [20.0, 20.0]] + [[0.0, 0.0]] * 4
    assert prompt.pass_positions(1, 6).tolist()[0] == [1, 1, 2, 3, 4, 5]
    assert prompt.merge(h, 3) is None
