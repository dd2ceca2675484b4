"""dflash-mlx: lossless DFlash block speculative decoding on MLX."""

from .draft import DFlashDraft, DraftConfig
from .errors import DFlashError
from .generate import GenerationResponse, GenerationResult, generate, stream_generate
from .loading import load, load_draft
from .target import Target

__all__ = [
    "DFlashDraft",
    "DFlashError",
    "DraftConfig",
    "GenerationResponse",
    "GenerationResult",
    "Target",
    "generate",
    "load",
    "load_draft",
    "stream_generate",
]
