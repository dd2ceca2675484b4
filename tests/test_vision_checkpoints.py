"""Checkpoints that carry a vision tower and an MTP head beside the language
model (Qwen3.8, model_type qwen3_5) load text-only: mlx-lm's sanitize drops
those tensors, and generation is the text model's own (docs/targets.md,
"Vision-carrying checkpoints")."""

import mlx.core as mx
from checkpoints import VISION_AND_MTP_TENSORS, write_vision_carrying_target
from mlx.utils import tree_flatten
from test_loop import greedy_reference

from dflash_mlx import generate, load, load_draft


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
