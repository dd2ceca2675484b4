"""``convert_draft``: a z-lab draft to an MLX draft directory, streamed tensor by tensor."""

import sys
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.utils import save_config

from dflash_mlx.atomic import check_output, staged_output
from dflash_mlx.draft import DSparkConfig
from dflash_mlx.errors import DFlashError
from dflash_mlx.loading import DRAFT_FILES, resolve

from .checkpoint import expected_shapes, open_tensors, read_config, validate
from .quant import RECIPES, plan, quantization_block, quantize_weight
from .writer import SHARD_BYTES, write_shards

DTYPES = ("float16", "bfloat16", "float32")
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_options(bits: Optional[int], group_size: int, dtype: Optional[str], recipe: Optional[str]) -> None:
    """Reject option values the converter does not support, with a one-line error."""
    if bits is not None and bits not in BITS:
        raise DFlashError(f"--q-bits must be 4 or 8, got {bits}")
    if group_size not in GROUP_SIZES:
        raise DFlashError(f"--q-group-size must be 32, 64 or 128, got {group_size}")
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    if recipe is not None and recipe not in RECIPES:
        raise DFlashError(f"unknown draft recipe '{recipe}'; choose from {', '.join(RECIPES)}")
    if recipe is not None and bits == 8:
        raise DFlashError(f"--recipe {recipe} quantizes the draft to 4 bits; drop --q-bits 8")


def convert_draft(
    src: str,
    out: Path,
    *,
    bits: Optional[int] = None,
    group_size: int = 64,
    dtype: Optional[str] = None,
    recipe: Optional[str] = None,
    quantize_heads: bool = False,
    force: bool = False,
    shard_bytes: int = SHARD_BYTES,
    log: Callable[[str], None] = _stderr,
) -> Path:
    """Convert draft ``src`` (local directory or hub repo id) into ``out``.

    ``bits`` None keeps the weights unquantized; ``dtype`` None keeps each
    tensor's dtype; ``recipe="mixed_4_8"`` implies 4 bits with ``fc`` and the
    last layer at 8. A DSpark draft's Markov and confidence heads stay float
    unless ``quantize_heads`` (docs/dspark.md). Everything is validated before
    anything is written; peak memory is about the largest tensor plus one
    output shard.
    """
    check_options(bits, group_size, dtype, recipe)
    if recipe is not None:
        bits = 4
    if quantize_heads and not bits:
        raise DFlashError("--quantize-heads quantizes a DSpark draft's heads with the rest of it; give -q or --q-bits too")
    out = Path(out).expanduser()
    check_output(out, force)
    path = resolve(str(src), "draft", DRAFT_FILES)
    config = read_config(path)
    tensors = open_tensors(path, config)
    validate(config, tensors)
    if quantize_heads and not (isinstance(config, DSparkConfig) and (config.markov_rank or config.enable_confidence_head)):
        raise DFlashError(f"--quantize-heads applies to a DSpark draft's Markov and confidence heads; {path} has none")

    modules = plan(config, bits, group_size, recipe, quantize_heads) if bits else {}
    kept = [p for p, q in modules.items() if q is None]
    if modules and len(kept) == len(modules):
        raise DFlashError(
            f"no module's input width is a multiple of --q-group-size {group_size}, so nothing "
            "would be quantized; use a smaller group size"
        )
    if kept:
        log(f"kept {len(kept)} of {len(modules)} modules unquantized (input width not a "
            f"multiple of {group_size}): {', '.join(kept)}")
    if bits:
        config.quantization = quantization_block(modules, bits, group_size)
    cast = getattr(mx, dtype) if dtype else None

    def groups():
        for name in expected_shapes(config):
            weight = tensors.pop(name)
            if cast is not None and mx.issubdtype(weight.dtype, mx.floating):
                weight = weight.astype(cast)
            if not mx.isfinite(weight).all().item():
                bad = mx.logical_not(mx.isfinite(weight)).sum().item()
                log(f"warning: tensor '{name}' holds {bad} NaN or infinite values of {weight.size}")
            module = name.removesuffix(".weight")
            params = modules.get(module)
            if params is None:
                yield {name: weight}
            else:
                yield {f"{module}.{k}": v for k, v in quantize_weight(weight, params).items()}

    what = f"{bits}-bit" + (f" ({recipe})" if recipe else "") if bits else (dtype or "unquantized")
    log(f"converting {path} -> {out} ({what})")
    try:
        with staged_output(out, force, [path], log) as staged:
            write_shards(groups(), staged, shard_bytes, log)
            save_config(config.to_dict(), staged / "config.json")
    except (OSError, RuntimeError) as e:  # disk full, unreadable source, ...
        raise DFlashError(f"converting to '{out}' failed: {' '.join(str(e).split())}") from None
    return out
