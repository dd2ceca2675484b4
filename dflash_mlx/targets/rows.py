"""Caches of a batch whose rows have lengths of their own, for the batch decoder
(``loop/batch.py``).

mlx-lm's ``BatchKVCache`` keeps one cursor for the whole batch (rows are
left-padded to it), so it cannot keep 3 tokens of one row's verified block and
9 of another's. ``RowKVCache`` keeps a length per row instead: a pass over
[B, T] writes each row's T positions after its own last one, attention reads
up to the longest row, and the mask it makes hides every key past each row's
own length, so a row never attends to another row's positions, to a padding
slot, or to the rejected tail of its own last block (those slots are
overwritten by its next pass; nothing relies on them being zero). Trimming is
per row and moves no data.

Rows start at position ``start`` (0 for a target; a draft's sliding-window
context may have dropped its oldest positions): row r's index i holds
position ``start[r] + i``, the RoPE offset of its next key is
``start[r] + length[r]``.
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

STEP = 256  # buffer growth, as mlx-lm's KVCache


class RowKVCache:
    """Keys and values [B, heads, slots, head_dim] of rows with their own lengths."""

    def __init__(self, keys: Optional[mx.array] = None, values: Optional[mx.array] = None,
                 lengths: Optional[list[int]] = None, starts: Optional[list[int]] = None):
        self.keys, self.values = keys, values
        self.lengths = list(lengths or [])
        self.starts = list(starts or [0] * len(self.lengths))

    @property
    def offset(self) -> mx.array:
        """Per row, the position of its next key (the RoPE offset of a pass)."""
        return mx.array([s + n for s, n in zip(self.starts, self.lengths)], dtype=mx.int32)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def _reserve(self, end: int, like_k: mx.array, like_v: mx.array) -> None:
        if self.keys is not None and end <= self.keys.shape[2]:
            return
        B, H, _, D = like_k.shape
        size = ((end + STEP - 1) // STEP) * STEP
        keys = mx.zeros((B, H, size, D), like_k.dtype)
        values = mx.zeros((B, H, size, like_v.shape[3]), like_v.dtype)
        if self.keys is not None:
            held = self.keys.shape[2]
            keys[..., :held, :] = self.keys
            values[..., :held, :] = self.values
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's T new positions after its own last one; return
        every slot up to the longest row's end (the mask hides the rest)."""
        T = keys.shape[2]
        end = max(self.lengths) + T
        self._reserve(end, keys, values)
        if len(set(self.lengths)) == 1:
            n = self.lengths[0]
            self.keys[..., n : n + T, :] = keys
            self.values[..., n : n + T, :] = values
        else:  # one scatter per array: row r's T slots from its own length
            slots = (mx.array(self.lengths, dtype=mx.int32)[:, None] + mx.arange(T, dtype=mx.int32))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slots, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(slots, values.shape), values, axis=2)
        self.lengths = [n + T for n in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def visible(self, N: int, window: Optional[int] = None, causal: bool = True) -> mx.array:
        """Bool [B, 1, N, slots]: which slots each of the next N queries of each
        row sees (before ``update_and_fetch``): its own row's positions up to
        itself (``causal``) or up to the end of the N (not causal), within
        ``window`` positions of the query where a window is given."""
        lengths = mx.array(self.lengths, dtype=mx.int32)[:, None, None]
        query = lengths + mx.arange(N, dtype=mx.int32)[:, None]  # slot index of each query
        key = mx.arange(max(self.lengths) + N, dtype=mx.int32)[None, None]
        seen = key <= query if causal else key < lengths + N
        if window is not None:
            seen = seen & (query - key < window)
        return seen[:, None]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """mlx-lm's mask hook (``create_attention_mask``): causal, per row."""
        return self.visible(N, window_size)

    def trim_rows(self, counts: list[int]) -> None:
        """Forget the newest ``counts[r]`` positions of each row r."""
        self.lengths = [n - min(c, n) for n, c in zip(self.lengths, counts)]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.trim_rows([n] * self.batch_size)
        return n

    def row(self, r: int) -> tuple[Optional[mx.array], Optional[mx.array], int]:
        """Row r alone: (keys [1, H, n, D], values, its first position); no arrays if it holds none."""
        n = self.lengths[r]
        if self.keys is None or n == 0:
            return None, None, self.starts[r] + n
        return (mx.contiguous(self.keys[r : r + 1, :, :n]), mx.contiguous(self.values[r : r + 1, :, :n]),
                self.starts[r])

    def extract(self, r: int) -> KVCache:
        """Row r as mlx-lm's ``KVCache`` (a target's rows start at position 0)."""
        cache = KVCache()
        keys, values, _ = self.row(r)
        if keys is not None:
            cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
        return cache

    def filter(self, batch_indices: mx.array) -> None:
        """Keep only the rows at ``batch_indices`` [n], in that order (as mlx-lm's batch caches)."""
        rows = batch_indices.tolist()
        if self.keys is not None:
            self.keys, self.values = self.keys[batch_indices], self.values[batch_indices]
        self.lengths = [self.lengths[r] for r in rows]
        self.starts = [self.starts[r] for r in rows]

    def _held(self, like: "RowKVCache") -> tuple[mx.array, mx.array]:
        """This cache's keys and values; zero slots shaped as ``like``'s where it holds none."""
        if self.keys is not None:
            return self.keys, self.values
        zeros = lambda a: mx.zeros((self.batch_size, *a.shape[1:]), a.dtype)
        return zeros(like.keys), zeros(like.values)

    def extend(self, other: "RowKVCache") -> None:
        """Append ``other``'s rows."""
        like = self if self.keys is not None else other
        if like.keys is not None:
            (k1, v1), (k2, v2) = self._held(like), other._held(like)
            size = max(k1.shape[2], k2.shape[2])
            pad = lambda a: a if a.shape[2] == size else mx.pad(a, [(0, 0), (0, 0), (0, size - a.shape[2]), (0, 0)])
            self.keys = mx.concatenate([pad(k1), pad(k2)])
            self.values = mx.concatenate([pad(v1), pad(v2)])
        self.lengths = self.lengths + other.lengths
        self.starts = self.starts + other.starts

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def extend_rows(mine, theirs, rows_mine: int, rows_theirs: int) -> None:
    """``mine.extend(theirs)`` for a batch cache of ``rows_mine`` rows and one
    of ``rows_theirs``. mlx-lm's ``ArraysCache`` cannot tell how many rows it
    holds before its states exist (a request with nothing fed yet), so its
    missing states are zeros here, as its layer starts from zeros."""
    if not isinstance(mine, ArraysCache):
        mine.extend(theirs)
        return

    def joined(a: Optional[mx.array], b: Optional[mx.array]) -> Optional[mx.array]:
        like = a if a is not None else b
        if like is None:
            return None
        zeros = lambda n: mx.zeros((n, *like.shape[1:]), like.dtype)
        return mx.concatenate([zeros(rows_mine) if a is None else a, zeros(rows_theirs) if b is None else b])

    mine.cache = [joined(a, b) for a, b in zip(mine.cache, theirs.cache)]
