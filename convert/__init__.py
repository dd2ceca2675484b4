"""Convert DFlash drafts from the z-lab Hugging Face layout to MLX, optionally
4/8-bit quantized, and convert targets through mlx-lm's own converter.

Shipped inside the wheel as ``dflash_mlx.convert``; the ``dflash-mlx convert``
command is a thin wrapper around these two functions.
"""

from .draft import convert_draft
from .target import convert_target

__all__ = ["convert_draft", "convert_target"]
