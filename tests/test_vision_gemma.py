"""Gemma 4 targets with images (docs/vision.md, "Gemma 4"): the prefill over
the tower's features equals mlx-vlm's own logits and greedy generation, with
and without bidirectional attention within an image. The tiny multimodal
checkpoint is built with mlx-vlm's own classes and saved as mlx-vlm saves it;
mlx-vlm's own processor expands its prompts."""

import copy
import json
from pathlib import Path

import mlx.core as mx
import pytest
from checkpoints import _init_weights, _target_config, write_draft, write_tokenizer
from test_vision_checkpoints import assert_every_acceptance_length, image_messages, picture

from dflash_mlx import generate, load, load_draft

# the image's bounds and soft token, then the audio token: the last ids below <mask>
GEMMA_TOKENS = {"<|image>": "boi_token_id", "<|image|>": "image_token_id", "<image|>": "eoi_token_id",
                "<|audio|>": "audio_token_id"}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|image|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {{ eos_token }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_gemma_vision_target(path: Path, bidirectional: bool = True, seed: int = 0) -> dict:
    """A tiny Gemma 4 multimodal checkpoint (per-layer inputs, KV-shared
    layers, sliding window 4): mlx-vlm's model with random weights, saved by
    mlx-vlm, a tokenizer naming Gemma's image tokens, a chat template writing
    one ``<|image|>`` per image part, and the image processor's settings
    (images of up to 16 soft tokens). Returns the config."""
    pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")
    from mlx_vlm.models import gemma4
    from mlx_vlm.utils import save_config, save_weights
    from tokenizers import Tokenizer

    rope = {"full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # as published configs spell it
    config = _target_config("gemma4", {"use_bidirectional_attention": "vision" if bidirectional else None,
                                       "rope_parameters": rope})
    config["vision_config"] = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                               "global_head_dim": 8, "patch_size": 4, "pooling_kernel_size": 2,
                               "position_embedding_size": 64, "default_output_length": 16}
    vocab = config["vocab_size"]
    config.update({key: vocab - 5 + i for i, key in enumerate(GEMMA_TOKENS.values())})
    model_config = gemma4.ModelConfig.from_dict(copy.deepcopy(config))
    model_config.text_config = gemma4.TextConfig.from_dict(copy.deepcopy(config["text_config"]))
    model_config.vision_config = gemma4.VisionConfig.from_dict(copy.deepcopy(config["vision_config"]))
    model = gemma4.Model(model_config)
    _init_weights(model, seed)
    path = Path(path)
    save_weights(path, model)
    save_config(copy.deepcopy(config), path / "config.json")
    write_tokenizer(path, vocab - 5)  # then Gemma's four tokens, then <mask> again as the last id
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(list(GEMMA_TOKENS) + ["<mask_last>"])
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config.update(chat_template=GEMMA_TEMPLATE, extra_special_tokens={
        "boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>", "audio_token": "<|audio|>"})
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    processor = {"image_processor": {"patch_size": 4, "max_soft_tokens": 16, "pooling_kernel_size": 2}}
    (path / "processor_config.json").write_text(json.dumps(processor))
    return config


@pytest.fixture(scope="module", params=[True, False], ids=["bidirectional", "causal"])
def gemma_vision(request, tmp_path_factory):
    """(target dir, draft dir) of the tiny Gemma 4 multimodal pair."""
    path = tmp_path_factory.mktemp("gemma-vision")
    config = write_gemma_vision_target(path / "target", request.param)
    write_draft(path / "draft", config, block_size=8)
    return path / "target", path / "draft"


def vlm_inputs(target_dir: Path, tokenizer, messages: list, images: list):
    """mlx-vlm's own model of the checkpoint, and its processor's ids and keyword inputs."""
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4Processor
    from mlx_vlm.utils import load_model

    from dflash_mlx.chat import apply_template

    processor = Gemma4Processor.from_pretrained(str(target_dir))
    out = processor(text=apply_template(tokenizer, messages), images=images, add_special_tokens=False)
    return load_model(target_dir), out["input_ids"], dict(pixel_values=out["pixel_values"],
                                                          mm_token_type_ids=out["mm_token_type_ids"])


def vlm_greedy(vlm, ids: mx.array, inputs: dict, n: int) -> list[int]:
    from mlx_vlm.generate.ar import generate_step

    inputs = dict(inputs)
    return [int(t) for t, _ in generate_step(ids, vlm, inputs.pop("pixel_values"), None, max_tokens=n,
                                             temperature=0.0, **inputs)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_image_prompt_prefills_to_mlx_vlm_s_logits_and_drafts_at_every_acceptance_length(gemma_vision):
    from dflash_mlx.chat import template_ids
    from dflash_mlx.targets import Target
    from dflash_mlx.vision import with_images

    target_dir, _ = gemma_vision
    model, tokenizer = load(str(target_dir))
    messages = image_messages("what is this", 2)
    images = [picture(1), picture(2, (36, 20))]
    target, expanded, _ = with_images(Target(model), mx.array(template_ids(tokenizer, messages)), images)
    vlm, ids, inputs = vlm_inputs(target_dir, tokenizer, messages, images)
    assert expanded.tolist() == ids[0].tolist()  # the placeholders expand as mlx-vlm's processor expands them

    theirs = vlm(ids, **inputs).logits
    ours = target.logits(target.forward(expanded[None], target.make_cache(), [1]).hidden)
    assert mx.abs(ours - theirs).max().item() < 1e-4 * mx.abs(theirs).max().item() + 1e-3

    # prefill chunks of 5 end inside both images
    assert_every_acceptance_length(target, expanded, vlm_greedy(vlm, ids, inputs, 3 * 4 + 2), 4)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("block_size", [2, 8])
def test_dflash_with_an_image_equals_mlx_vlm_s_greedy_generation(gemma_vision, block_size):
    from dflash_mlx.chat import template_ids

    target_dir, draft_path = gemma_vision
    model, tokenizer = load(str(target_dir))
    messages = image_messages("describe it", 1)
    vlm, ids, inputs = vlm_inputs(target_dir, tokenizer, messages, [picture(3)])
    want = vlm_greedy(vlm, ids, inputs, 24)
    draft = load_draft(str(draft_path))
    prompt = template_ids(tokenizer, messages)
    got = generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=block_size, images=[picture(3)])
    assert got.tokens == want[: len(got.tokens)] and (len(got.tokens) == 24 or got.finish_reason == "stop")
    other = generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=block_size, images=[picture(4)])
    assert other.tokens != got.tokens


def test_a_gemma4_target_without_a_vision_tower_refuses_an_image_in_one_line(tmp_path):
    from checkpoints import write_target

    from dflash_mlx import DFlashError
    from dflash_mlx.targets import Target
    from dflash_mlx.vision import with_images

    for family, reason in (("gemma4", "has no vision tower"), ("gemma4_text", "takes no images")):
        write_target(tmp_path / family, family)
        model, _ = load(str(tmp_path / family))
        with pytest.raises(DFlashError) as e:
            with_images(Target(model), mx.array([1, 2]), [picture(1)])
        assert reason in str(e.value) and "\n" not in str(e.value)
