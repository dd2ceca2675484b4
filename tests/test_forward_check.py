"""The load-time proof that the adapter's layer loop is the model's own forward:
it passes on every supported family and stops generation with one clear line
when mlx-lm's forward and ours part ways (a plain layer loop that no longer
matches, or a GatedDeltaNet recording copy that no longer matches)."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.qwen3_5 import GatedDeltaNet

from checkpoints import FAMILIES
from dflash_mlx import DFlashError, Target, generate, load_draft
from dflash_mlx.targets.forward_check import TOLERANCE, forward_mismatch

TOKENS = mx.array([5, 17, 40, 3, 99, 12, 7, 61])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_passes(target_dirs, family):
    model, _ = mlx_lm_load(str(target_dirs[family]))
    error, dtype = forward_mismatch(Target(model), TOKENS)
    assert error <= TOLERANCE[dtype] / 100  # far inside the tolerance


class LoudGatedDeltaNet(GatedDeltaNet):
    """mlx-lm's layer as a future release might change it: the model's own
    forward runs this, the adapter's recording copy does not."""

    def __call__(self, *args, **kwargs):
        return 1.5 * super().__call__(*args, **kwargs)


def test_a_changed_recurrent_layer_stops_generation(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    draft = load_draft(str(draft_dir("qwen3_5")))
    layer = next(l for l in model.layers if getattr(l, "is_linear", False))
    layer.linear_attn.__class__ = LoudGatedDeltaNet  # this instance only
    with pytest.raises(DFlashError, match=r"differs from the model's own .* under mlx-lm \d") as e:
        generate(model, draft, tokenizer, "the quick brown fox", max_tokens=4)
    assert "\n" not in str(e.value)


def test_a_changed_model_forward_stops_generation(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["llama"]))
    draft = load_draft(str(draft_dir("llama")))
    inner = model.model

    class ScaledEmbeddings(type(inner)):  # a model that scales its embeddings, which the adapter does not
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return super().__call__(inputs, cache, input_embeddings=2.0 * self.embed_tokens(inputs))

    inner.__class__ = ScaledEmbeddings
    with pytest.raises(DFlashError, match="llama"):
        generate(model, draft, tokenizer, "the quick brown fox", max_tokens=4)


def test_checked_once_per_model_instance(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    draft = load_draft(str(draft_dir("qwen3_5")))
    first = generate(model, draft, tokenizer, "the quick brown fox", max_tokens=4)
    layer = next(l for l in model.layers if getattr(l, "is_linear", False))
    layer.linear_attn.__class__ = LoudGatedDeltaNet  # after a passed check: not checked again
    generate(model, draft, tokenizer, "the quick brown fox", max_tokens=4)
    fresh, _ = mlx_lm_load(str(target_dirs["qwen3_5"]))  # a new instance is checked
    assert generate(fresh, draft, tokenizer, "the quick brown fox", max_tokens=4).tokens == first.tokens
