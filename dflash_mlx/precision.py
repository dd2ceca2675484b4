"""The dtype a draft computes in, chosen per chip (docs/cli.md, "Draft precision").

Apple's M1 and M2 GPUs have no native bfloat16: MLX emulates it there, and the
float16 peers cast to instead overflows DFlash2 drafts to inf/NaN. On those chips
the draft's floating weights (and so its activations) become float32; elsewhere
the checkpoint's own dtype is kept. ``--draft-dtype`` overrides the choice.
"""

import os
import re
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import DFlashError

DRAFT_DTYPES = ("auto", "keep", "float32", "bfloat16", "float16")

# Apple GPU generations without native bfloat16: applegpu_g13* is M1, applegpu_g14* M2
_EMULATED_BF16 = re.compile(r"applegpu_g1[34]|\bapple m[12]\b", re.I)


def device_description() -> dict:
    """``mx.device_info()`` of the default device, with the machine's memory
    from the OS where the backend names none (the CPU backend)."""
    try:
        info = dict(mx.device_info())
    except Exception:  # an MLX without device_info
        info = {}
    if not info.get("memory_size"):
        try:
            info["memory_size"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
    return info


def bf16_emulated(info: dict) -> bool:
    """Whether the GPU ``info`` describes (its ``architecture`` or ``device_name``)
    is an M1 or M2, which compute bfloat16 by emulation."""
    return any(_EMULATED_BF16.search(str(info.get(key, ""))) for key in ("architecture", "device_name"))


def choose_draft_dtype(info: dict, requested: str = "auto") -> tuple[Optional[mx.Dtype], str]:
    """(the dtype to cast the draft to, None to keep the checkpoint's; why) for
    the device ``info`` describes and the ``--draft-dtype`` value ``requested``."""
    if requested not in DRAFT_DTYPES:
        raise DFlashError(f"--draft-dtype must be one of {', '.join(DRAFT_DTYPES)}; got '{requested}'")
    if requested == "keep":
        return None, "the checkpoint's dtype (--draft-dtype keep)"
    if requested != "auto":
        return getattr(mx, requested), f"{requested} (--draft-dtype)"
    name = info.get("device_name") or info.get("architecture") or "this device"
    if bf16_emulated(info):
        return mx.float32, f"float32: {name} emulates bfloat16, and float16 overflows drafts"
    return None, f"the checkpoint's dtype: {name} is not an M1/M2 (no bfloat16 emulation)"


def cast_draft(draft: nn.Module, dtype: Optional[mx.Dtype]) -> nn.Module:
    """The draft with its floating parameters (quantization scales and biases
    included; packed weights are integers) in ``dtype``; unchanged for None."""
    if dtype is not None:
        draft.set_dtype(dtype)
    return draft


def dtype_name(model: nn.Module) -> str:
    """The dtype(s) of the model's floating parameters, e.g. 'float32' (a
    quantized model's: its scales and biases; packed weights are integers)."""
    names = {str(v.dtype).rsplit(".", 1)[-1] for _, v in tree_flatten(model.parameters())
             if mx.issubdtype(v.dtype, mx.floating)}
    return ", ".join(sorted(names))
