"""Writing a trained draft: the MLX layout ``load_draft`` reads, and the
Hugging Face layout (z-lab's for DFlash drafts, vLLM and SGLang load it;
DeepSpec's for DSpark drafts). Both are written atomically and never with NaN
or infinite weights."""

from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config

from ..atomic import staged_output
from ..draft import DFlash2Draft, DFlashDraft, DSparkDraft
from ..errors import DFlashError
from .loop import all_finite


def _write(path: Path, weights: dict, config: dict, fmt: str) -> Path:
    path = Path(path)
    if not all_finite(weights):
        raise DFlashError(f"the draft's weights hold NaN or infinite values; '{path}' was not written")
    with staged_output(path, force=True) as tmp:
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": fmt})
        save_config(config, tmp / "config.json")
    return path


def save_draft(draft: DFlashDraft, path: Path, dtype: Optional[str] = None) -> Path:
    """The MLX layout ``load_draft`` reads (config + model.safetensors)."""
    weights = dict(tree_flatten(draft.parameters()))
    if dtype:
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    return _write(path, weights, draft.config.to_dict(), "mlx")


def borrowed(target) -> dict:
    """The target's embedding and head as [V, H] tensors under DeepSpec's
    names (its checkpoints carry frozen copies; ``load_draft`` drops them)."""
    V, H = target.vocab_size, target.hidden_size
    return {"embed_tokens.weight": target.embed_rows(mx.arange(V)),
            "lm_head.weight": target.head_logits(mx.eye(H)).T}


def export_hf(draft: DFlashDraft, path: Path, dtype: str = "bfloat16", target=None) -> Path:
    """The z-lab Hugging Face layout (newer config dialect, PyTorch-style
    safetensors), as vLLM and SGLang load DFlash drafts; a DFlash2 draft's
    config names ``DFlash2DraftModel`` and its codebooks lose ``.weight``. A
    DSpark draft is written in DeepSpec's layout (its config's flat keys,
    ``block_size`` the trained gamma) with ``target``'s embedding and head
    copied in (``borrowed``) where it is given."""
    c = draft.config
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(draft.parameters())}
    if isinstance(draft, DFlash2Draft):
        weights = draft.hf_weights(weights)
    if isinstance(draft, DSparkDraft):
        if target is not None:
            weights.update({k: v.astype(getattr(mx, dtype)) for k, v in borrowed(target).items()})
        config = {**c.to_dict(), "hidden_act": "silu", "attention_dropout": 0.0, "use_cache": True,
                  "torch_dtype": dtype}
        config.pop("quantization", None)
        return _write(path, weights, config, "pt")
    config = {
        **c.to_dict(),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
        "block_size": c.block_size,
    }
    config.pop("quantization", None)
    return _write(path, weights, config, "pt")
