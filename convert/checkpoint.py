"""Reading a source draft lazily and checking it completely before anything is written."""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx.draft import DraftConfig, draft_classes, network_class
from dflash_mlx.errors import DFlashError

FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_config(path: Path) -> DraftConfig:
    """Parse ``config.json`` (either z-lab dialect, v1 or DFlash2) of an unquantized draft."""
    file = path / "config.json"
    if not file.is_file():
        raise DFlashError(f"draft directory '{path}' has no config.json")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"draft config '{file}' is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DFlashError(f"draft config '{file}' is not a JSON object")
    if raw.get("quantization"):
        raise DFlashError(
            f"draft '{path}' is already quantized; convert the unquantized z-lab checkpoint"
        )
    try:
        return draft_classes(raw)[1].from_dict(raw)
    except DFlashError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise DFlashError(f"draft config '{file}' has an invalid field: {e}") from None


def open_tensors(path: Path, config: DraftConfig) -> dict[str, mx.array]:
    """Every tensor of ``model*.safetensors``, memory-mapped lazily (nothing is
    read yet), under the names the draft network uses (DFlash2's codebooks
    gain ``.weight``)."""
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise DFlashError(f"draft directory '{path}' has no model*.safetensors weights")
    tensors = {}
    for file in files:
        try:
            loaded = mx.load(str(file))
        except Exception as e:
            raise DFlashError(f"cannot read weights '{file}': {e}") from None
        for name, array in loaded.items():
            if name in tensors:
                raise DFlashError(f"tensor '{name}' appears in more than one weight file")
            tensors[name] = array
    sanitize = getattr(network_class(config)(config), "sanitize", None)  # lazy: nothing is initialized
    return sanitize(tensors) if sanitize else tensors


def _parameters(config: DraftConfig) -> dict[str, mx.array]:
    """The draft network's parameters, never materialized (only shapes and dtypes are read)."""
    return dict(tree_flatten(network_class(config)(config).parameters()))


def expected_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape the draft needs; the weights are never materialized."""
    return {name: tuple(p.shape) for name, p in _parameters(config).items()}


def validate(config: DraftConfig, tensors: dict[str, mx.array]) -> None:
    """Raise a one-line DFlashError naming the first field or tensor that is wrong."""
    ids, L, H = config.target_layer_ids, config.num_target_layers, config.hidden_size
    out_of_range = [i for i in ids if not 0 <= i < L]
    if out_of_range:
        raise DFlashError(
            f"draft config target_layer_ids {ids} has {out_of_range} outside the "
            f"{L} target layers (num_target_layers)"
        )
    fc = tensors.get("fc.weight")
    if fc is not None and fc.ndim == 2 and fc.shape[1] != config.feature_size:
        raise DFlashError(
            f"tensor 'fc.weight' takes {fc.shape[1]} input features but target_layer_ids "
            f"{ids} needs {len(ids)} x hidden_size {H} = {config.feature_size}"
        )
    expected = expected_shapes(config)
    # integer parameters (a reduced drafting vocabulary's d2t map) stay integers
    integers = {name for name, p in _parameters(config).items() if mx.issubdtype(p.dtype, mx.integer)}
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise DFlashError(f"draft checkpoint is missing tensor {_names(missing)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise DFlashError(
                f"tensor '{name}' has shape {list(tensors[name].shape)}; "
                f"the config implies {list(shape)}"
            )
        dtype = tensors[name].dtype
        if (not mx.issubdtype(dtype, mx.integer)) if name in integers else dtype not in FLOATS:
            kind = "an integer" if name in integers else "a float"
            raise DFlashError(f"tensor '{name}' has dtype {dtype}; expected {kind}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise DFlashError(
            f"draft checkpoint has unexpected tensor {_names(unexpected)} that a "
            f"{config.num_hidden_layers}-layer DFlash draft does not use"
        )
