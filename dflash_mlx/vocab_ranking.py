"""``dflash-mlx draft-vocab``: rank a target's vocabulary by frequency over a
corpus and store the ranking beside its draft, for ``--draft-vocab N``
(the ranking itself: ``draft/vocab.py``).

It writes one file, ``draft_vocab.safetensors``, and only where that is safe:
never inside the installed package (the bundled demo draft keeps the ranking
it ships with), only beside a draft made for the target (the pair check
``generate`` runs), and only in place of an earlier ranking, never of another
file of that name.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .draft import RANKING_FILE, rank_corpus, read_ranking, write_ranking
from .errors import DFlashError
from .generate import check_pair
from .loading import TOKENIZER_FILES, check_tokenizer, load_draft, resolve
from .registry import read_config, resolve_pair
from .validate import writable

PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class TargetShape:
    """What ``check_pair`` reads of a target, from its config.json alone."""

    hidden_size: int
    vocab_size: int
    num_layers: int


def target_shape(target: str) -> TargetShape:
    config = read_config(target, "target")
    text = config.get("text_config") or config
    try:
        return TargetShape(int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]))
    except (KeyError, TypeError, ValueError) as e:
        raise DFlashError(f"target '{target}' config.json has no usable {e}; is it an mlx-lm model?") from None


def check_ranking_destination(draft_dir: Path) -> None:
    """DFlashError unless a ranking may be written into ``draft_dir``."""
    if draft_dir.resolve().is_relative_to(PACKAGE_DIR):
        raise DFlashError(f"'{draft_dir}' is part of the installed dflash-mlx and keeps the ranking it ships "
                          "with; copy the draft directory and pass --model TARGET --draft COPY")
    writable(draft_dir, "--draft")  # before the corpus is read, not after
    existing = draft_dir / RANKING_FILE
    if existing.exists() and not existing.is_file():
        raise DFlashError(f"'{existing}' is not a file; move it away to store a ranking there")
    try:
        read_ranking(draft_dir)
    except DFlashError:
        raise DFlashError(f"'{existing}' is not a ranking written by dflash-mlx draft-vocab; "
                          "move it away to store a ranking there") from None


def rank_for_draft(corpus: Sequence[str], model: Optional[str], draft: Optional[str]) -> tuple[Path, int, int]:
    """Rank the target's vocabulary over ``corpus`` and store it beside the
    draft; returns (the ranking's path, the vocabulary size, tokens counted)."""
    from mlx_lm.utils import load_tokenizer

    pair = resolve_pair(model, draft)
    draft_dir = resolve(pair.draft, "draft")
    check_ranking_destination(draft_dir)
    shape = target_shape(pair.target)
    check_pair(shape, load_draft(str(draft_dir), lazy=True))
    tokenizer_dir = resolve(pair.target, "target", TOKENIZER_FILES)
    check_tokenizer(tokenizer_dir)
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except Exception as e:
        raise DFlashError(f"cannot load the tokenizer of target '{pair.target}': {e}") from None
    ranking, counted = rank_corpus(tokenizer, corpus, shape.vocab_size)
    try:
        path = write_ranking(draft_dir, ranking)
    except OSError as e:
        raise DFlashError(f"cannot write the ranking into '{draft_dir}': {e.strerror or e}") from None
    return path, shape.vocab_size, counted
