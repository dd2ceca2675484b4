"""A reduced drafting vocabulary: the draft's logits over the N most frequent ids.

The draft borrows the target's LM head, and on a large vocabulary that head is
most of the draft's cost (Qwen3.5-9B: 248k rows, 2 GB in bfloat16, read every
cycle). A ranking of the vocabulary by frequency in a corpus is stored beside
the draft (``draft_vocab.safetensors``, written by ``dflash-mlx draft-vocab``);
with ``draft_vocab=N`` the proposer multiplies by the head's N top-ranked rows
only, sliced once, and every other id gets logit -inf: it is never proposed.

Lossless: verification always runs the target's full head, and the sampler
drafts from exactly the distribution it reports as q (zero outside the subset),
so rejection sampling stays exact; greedy drafts are the subset's argmax.
"""

import weakref
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from safetensors.numpy import load_file, save_file

from ..atomic import staged_file
from ..errors import DFlashError
from ..targets import Target

RANKING_FILE = "draft_vocab.safetensors"
RANKING_KEY = "token_ids"


def rank_tokens(token_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """Every id of the vocabulary, most frequent in ``token_ids`` first; ties
    (unseen ids included) in id order."""
    ids = np.fromiter(token_ids, dtype=np.int64)
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise DFlashError(f"token id {outside[0]} is outside the vocabulary of {vocab_size}")
    frequency = np.bincount(ids, minlength=vocab_size)
    return np.argsort(-frequency, kind="stable").astype(np.int32)


def rank_corpus(tokenizer, paths: Sequence[str], vocab_size: int) -> tuple[np.ndarray, int]:
    """(ranking, tokens counted) over text/JSONL files or directories, tokenized
    as ``dflash-mlx train`` reads its data."""
    from ..train.records import read_records, record_ids

    for path in paths:
        if not Path(path).expanduser().exists():
            raise DFlashError(f"corpus path '{path}' does not exist")
    ids: list[int] = []
    for record in read_records(paths):
        ids += record_ids(tokenizer, record)[0]
    return rank_tokens(ids, vocab_size), len(ids)


def write_ranking(draft_dir: Path, ranking: np.ndarray) -> Path:
    """Store ``ranking`` beside the draft (replacing any earlier one whole)."""
    path = Path(draft_dir) / RANKING_FILE
    with staged_file(path) as tmp:
        save_file({RANKING_KEY: np.ascontiguousarray(ranking, dtype=np.int32)}, str(tmp))
        tmp.chmod(0o644)  # as the draft's other files, not the writer's private 0600
    return path


def read_ranking(draft_dir: Path) -> Optional[np.ndarray]:
    """The ranking stored beside the draft, or None; a damaged one is an error."""
    path = Path(draft_dir) / RANKING_FILE
    if not path.is_file():
        return None
    remake = "remake it with dflash-mlx draft-vocab"
    try:
        ranking = load_file(str(path))[RANKING_KEY]
    except Exception as e:
        raise DFlashError(f"'{path}' is not a draft vocabulary ranking ({e}); {remake}") from None
    if ranking.ndim != 1 or ranking.dtype != np.int32:
        raise DFlashError(f"'{path}' holds {ranking.dtype} {ranking.shape}, not int32 ids; {remake}")
    return ranking


class SubsetHead:
    """The target's LM head over ``ids`` only; logits are full width, -inf
    outside ``ids``. Float, tied-embedding and quantized heads alike. As
    ``Target``, ``head_logits`` is the head's raw output and ``logits`` the
    model's (soft-capped where the model caps them, Gemma 4); a cap or scale
    applies to the kept ids only, so the others stay -inf."""

    def __init__(self, target: Target, ids: mx.array):
        head = target.head_module
        self.ids = ids
        self.finish_logits = target.stack.finish_logits
        self.vocab_size = target.vocab_size
        rows = {name: head[name][ids] for name in ("weight", "scales", "biases", "bias") if name in head}
        mx.eval(rows)  # sliced once, not on every call
        self.weight, self.bias = rows["weight"], rows.get("bias")
        self.scales, self.biases = rows.get("scales"), rows.get("biases")
        self.quantized = isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        if self.quantized:
            self.group_size, self.bits = head.group_size, head.bits
            self.mode = getattr(head, "mode", "affine")

    def head_logits(self, hidden: mx.array) -> mx.array:
        return self._place(self._rows(hidden))

    def logits(self, hidden: mx.array) -> mx.array:
        return self._place(self.finish_logits(self._rows(hidden)))

    def _rows(self, hidden: mx.array) -> mx.array:
        """The head's raw output on the kept ids [..., N]."""
        if self.quantized:
            sub = mx.quantized_matmul(hidden, self.weight, self.scales, self.biases, transpose=True,
                                      group_size=self.group_size, bits=self.bits, mode=self.mode)
        else:
            sub = hidden @ self.weight.T
        return sub if self.bias is None else sub + self.bias

    def _place(self, sub: mx.array) -> mx.array:
        return place(sub, self.ids, self.vocab_size)


def place(sub: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """Values [..., N] over ``ids`` as full-width rows [..., vocab_size], -inf elsewhere."""
    full = mx.full((*sub.shape[:-1], vocab_size), -mx.inf, dtype=sub.dtype)
    return mx.put_along_axis(full, mx.broadcast_to(ids, sub.shape), sub, axis=-1)


_HEADS: dict[int, dict[bytes, SubsetHead]] = {}  # id(model) -> the kept ids' bytes -> head, dropped with the model


def subset_head(target: Target, ranking: Union[np.ndarray, DFlashError, None], size: int) -> SubsetHead:
    """The head over the ``size`` top-ranked ids, sliced once per model and size.
    ``ranking`` is the draft's ``vocab_ranking``: the ids, None, or the error
    reading a damaged ranking gave (raised here, where it is needed)."""
    if isinstance(ranking, DFlashError):
        raise ranking
    if ranking is None:
        raise DFlashError(f"a reduced drafting vocabulary needs a ranking beside the draft ({RANKING_FILE}); "
                          "make one with: dflash-mlx draft-vocab --draft DRAFT CORPUS...")
    if ranking.size != target.vocab_size:
        raise DFlashError(f"the draft's vocabulary ranking covers {ranking.size} ids but the target has "
                          f"{target.vocab_size}; remake it with dflash-mlx draft-vocab for this target")
    if not 1 <= size <= ranking.size:
        raise DFlashError(f"the drafting vocabulary must be from 1 to the vocabulary size {ranking.size}, got {size}")
    return head_over(target, np.sort(ranking[:size]))


def head_over(target: Target, ids: np.ndarray) -> SubsetHead:
    """The target's head over ``ids`` (increasing int32), sliced once per model and id set."""
    key = id(target.model)
    if key not in _HEADS:
        _HEADS[key] = {}
        weakref.finalize(target.model, _HEADS.pop, key, None)
    heads, kept = _HEADS[key], np.ascontiguousarray(ids, dtype=np.int32)
    if kept.tobytes() not in heads:
        heads[kept.tobytes()] = SubsetHead(target, mx.array(kept))
    return heads[kept.tobytes()]
