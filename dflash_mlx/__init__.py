"""dflash-mlx: lossless DFlash block speculative decoding on MLX."""

from . import loop  # noqa: F401  (before draft/: its kernels use loop/acceptance.py, and the loop needs draft/)
from .draft import DFlashDraft, DraftConfig
from .errors import DFlashError
from .batch_generate import batch_generate
from .generate import GenerationResponse, GenerationResult, generate, stream_generate
from .loading import load, load_draft
from .targets import Target

__all__ = [
    "DFlashDraft",
    "DFlashError",
    "DraftConfig",
    "GenerationResponse",
    "GenerationResult",
    "Target",
    "batch_generate",
    "generate",
    "load",
    "load_draft",
    "stream_generate",
]
