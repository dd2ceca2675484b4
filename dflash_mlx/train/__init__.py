"""Training DFlash drafts (``dflash-mlx train``); see ``docs/architecture.md``.

Modules, one concern each: ``config`` (what to train), ``records`` and
``data`` (corpus and self-distillation), ``objective`` (the block-diffusion
loss), ``dflash2`` (a DFlash2 draft's start and its selector's loss), ``dspark``
(a DSpark draft's block and loss),
``loop`` (optimizer, schedule, checkpoints, ``fit``), ``progress``,
``evaluate`` (held-out tau), ``export`` (written drafts) and ``command``
(``train_draft`` and the CLI glue).
"""

from .command import train_draft
from .config import DraftTrainConfig
from .loop import OptimConfig, fit

__all__ = ["DraftTrainConfig", "OptimConfig", "fit", "train_draft"]
