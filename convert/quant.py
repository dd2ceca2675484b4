"""Which draft modules get quantized how, and quantizing one weight at a time.

The rules are mlx-lm's ``quantize_model`` rules (a module with ``to_quantized``
whose input width divides the group size), and the packing is MLX's own
``Linear.to_quantized``; the result loads with ``mlx_lm.utils.load_model``.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.draft import DraftConfig, network_class

RECIPES = ("mixed_4_8",)


def plan(
    config: DraftConfig, bits: int, group_size: int, recipe: Optional[str] = None, heads: bool = False
) -> dict[str, Optional[dict]]:
    """Module path -> ``to_quantized`` arguments, or None where it stays unquantized.

    ``mixed_4_8`` keeps ``fc`` and every module of the last layer at 8 bits.
    A DFlash2 draft's selector codebooks are embedding tables and quantize
    like the linear layers (the gathered rows are dequantized). A network's
    ``FLOAT_HEADS`` (DSpark's Markov and confidence heads) are left out, so
    they stay float, unless ``heads``.
    """
    last = f"layers.{config.num_hidden_layers - 1}."
    network = network_class(config)(config)
    floating = () if heads else getattr(network, "FLOAT_HEADS", ())
    result = {}
    for path, module in network.named_modules():
        if not hasattr(module, "to_quantized") or path.split(".")[0] in floating:
            continue
        if module.weight.shape[-1] % group_size:
            result[path] = None
            continue
        high = recipe == "mixed_4_8" and (path == "fc" or path.startswith(last))
        result[path] = {"group_size": group_size, "bits": 8 if high else bits, "mode": "affine"}
    return result


def quantization_block(modules: dict[str, Optional[dict]], bits: int, group_size: int) -> dict:
    """The config's ``quantization`` entry: defaults plus per-module overrides."""
    block = {"group_size": group_size, "bits": bits, "mode": "affine"}
    block.update({p: q for p, q in modules.items() if q is not None and q["bits"] != bits})
    return block


def quantize_weight(weight: mx.array, params: dict) -> dict[str, mx.array]:
    """``weight``/``scales``/``biases`` of the quantized Linear holding ``weight`` (lazy)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = weight
    quantized = linear.to_quantized(**params)
    return {k: v for k, v in quantized.parameters().items() if v is not None}
