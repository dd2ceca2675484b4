"""The vision tower beside a loaded text model, and a prompt's images laid
over its ids.

``dflash_mlx.load`` remembers which checkpoint each target came from
(``remember``). At a target's first prompt with images its checkpoint is read
again with mlx-vlm's classes, lazily: only the vision tower's weights (and the
few modules the family's positions need) are ever read, while the language
model stays mlx-lm's. mlx-vlm is the optional ``vision`` extra."""

import bisect
import itertools
import json
import threading
import weakref
from pathlib import Path
from typing import Union

import mlx.core as mx
import mlx.nn as nn

from ..errors import DFlashError
from ..targets import Target
from .sources import ImageSource, read_image
from .gemma import GemmaVision
from .qwen import QwenVision
from .target import ImagePrompt, VisionTarget

FAMILIES = {"qwen3_5": QwenVision, "qwen3_5_moe": QwenVision, "gemma4": GemmaVision}  # model type -> its vision
EXTRA = ("images need mlx-vlm, the optional 'vision' extra: pip install mlx-vlm "
         "(in a clone of dflash-mlx: pip install '.[vision]')")

_paths: dict[int, tuple[weakref.ref, Path]] = {}  # id(model) -> (the model, its checkpoint), while it lives
_towers: dict[int, object] = {}  # id(model) -> its family's vision tower, once read
_lock = threading.Lock()


def _forget(key: int) -> None:
    _paths.pop(key, None)
    _towers.pop(key, None)


def remember(model: nn.Module, path: Path) -> None:
    """Note the checkpoint directory ``model`` was loaded from."""
    key = id(model)
    _paths[key] = (weakref.ref(model, lambda _: _forget(key)), Path(path))


def _load(model: nn.Module, model_type: str):
    ref, path = _paths.get(id(model), (None, None))
    if ref is None or ref() is not model:
        raise DFlashError("images need a target loaded with dflash_mlx.load (the vision tower is read "
                          "from the same checkpoint directory)")
    config = json.loads((path / "config.json").read_text())
    if not config.get("vision_config"):
        raise DFlashError(f"target '{path}' has no vision tower (its config.json has no vision_config); "
                          "images need a multimodal checkpoint of the model")
    try:
        from mlx_vlm.utils import load_model
    except ImportError:
        raise DFlashError(EXTRA) from None
    try:
        vlm = load_model(path, lazy=True)
        return FAMILIES[model_type](vlm, path, getattr(model, "language_model", model))
    except DFlashError:
        raise
    except Exception as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DFlashError(f"cannot load the vision tower of '{path}' with mlx-vlm: {reason}") from None


def tower(target: Target):
    """The vision tower of ``target``'s model, read at first use (one-line
    DFlashError for a family or checkpoint without one)."""
    if target.model_type not in FAMILIES:
        raise DFlashError(f"target model type '{target.model_type}' takes no images; "
                          f"images work with {', '.join(FAMILIES)} checkpoints that carry a vision tower")
    with _lock:
        found = _towers.get(id(target.model))
        if found is None:
            found = _towers[id(target.model)] = _load(target.model, target.model_type)
    return found


def user_turn(text: str, images) -> Union[str, list[dict]]:
    """The user's turn for the chat template: ``text`` alone, or after one image part per image."""
    if not images:
        return text
    return [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]


def with_images(target: Target, ids: mx.array, images: list[ImageSource]) -> tuple[VisionTarget, mx.array, list[str]]:
    """(the target for this prompt, with its ``key``, its ids with every image
    placeholder expanded to the image's rows, each image's hash). The prompt holds one
    placeholder per image, as the chat template writes image parts."""
    if type(target) is not Target:
        raise DFlashError("images need a single-process target (not a sharded or distributed one)")
    family = tower(target)
    ids = ids.tolist()
    placeholders = ids.count(family.image_token_id)
    if placeholders != len(images):
        raise DFlashError(f"the prompt holds {placeholders} image placeholder(s) for {len(images)} image(s); "
                          "format it with the chat template and one image part per image")
    loaded = [read_image(source) for source in images]
    features, rows, extra = family.encode([image.pixels for image in loaded])
    expanded = family.expand(ids, rows)
    index = mx.cumsum(mx.array([t == family.image_token_id for t in expanded]).astype(mx.int32)) - 1
    where = [r if t == family.image_token_id else -1 for t, r in zip(expanded, index.tolist())]
    first = [0, *itertools.accumulate(rows)]  # each image's first row of ``features``
    digests = [image.digest for image in loaded]
    key = [t if r < 0 else -1 - int(digests[bisect.bisect_right(first, r) - 1][:15], 16)
           for t, r in zip(expanded, where)]
    prompt = ImagePrompt(features, where, key=key)
    if getattr(family, "bidirectional", False):
        prompt.spans = prompt.runs()
    expanded = mx.array(expanded)
    if hasattr(family, "positions"):
        prompt.positions, prompt.delta = family.positions(expanded, extra)
    return VisionTarget(target.model, family, prompt), expanded, digests
