"""One draft layer's context cache: the injected context keys and values, by
absolute position, holding only what a block query can still see.

A full-attention layer keeps every context position. A sliding-window layer's
block query at position t sees keys back to t - window + 1, so the layer needs
only the last ``window - 1`` context positions; older ones are dropped in
steps of ``slack`` positions (one copy of the kept window per ``slack``
injected positions), which bounds the layer's memory by about
``window - 1 + slack`` positions instead of the whole context. ``offset`` stays
the absolute number of positions injected (the RoPE position of the next
block); ``start`` is the oldest position still held.
"""

from typing import Optional

import mlx.core as mx

STEP = 256  # buffer growth, as mlx-lm's KVCache
SLACK = 1024  # positions beyond the window held before the oldest are dropped


class DraftContextCache:
    """Keys and values [B, heads, positions, head_dim] of the injected context."""

    def __init__(self, keep: Optional[int] = None, slack: int = SLACK):
        self.keep = keep  # context positions a block query can still see; None: all
        self.slack = slack
        self.keys: Optional[mx.array] = None  # buffer; position start + i at index i
        self.values: Optional[mx.array] = None
        self.start = 0
        self.offset = 0

    @property
    def held(self) -> int:
        return self.offset - self.start

    @classmethod
    def from_row(cls, keys: Optional[mx.array], values: Optional[mx.array], start: int, keep: Optional[int]) -> "DraftContextCache":
        """A cache holding ``keys``/``values`` [1, heads, n, head_dim] of positions start..start+n-1."""
        cache = cls(keep)
        held = 0 if keys is None else keys.shape[2]
        if held:
            cache.keys, cache.values = keys, values
        cache.start, cache.offset = start, start + held
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append positions offset..offset+T-1; return every held position's K and V."""
        T = keys.shape[2]
        if self.keys is None or self.held + T > self.keys.shape[2]:
            grow = ((T + STEP - 1) // STEP) * STEP
            new_k = mx.zeros((*keys.shape[:2], grow, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((*values.shape[:2], grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., : self.held, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., : self.held, :], new_v], axis=2)
        self.keys[..., self.held : self.held + T, :] = keys
        self.values[..., self.held : self.held + T, :] = values
        self.offset += T
        return self.keys[..., : self.held, :], self.values[..., : self.held, :]

    def skip(self, n: int) -> None:
        """Count the next ``n`` positions without holding them, nor any before
        them: for positions no block query will see (the caller knows the
        ``keep`` positions after them follow)."""
        self.offset += n
        self.start = self.offset
        self.keys = self.values = None

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` positions (no further back than ``start``)."""
        n = min(n, self.held)
        self.offset -= n
        return n

    def can_trim(self, n: int) -> bool:
        """Whether trimming ``n`` positions leaves everything the window then needs."""
        after = self.offset - n
        return n <= self.held and (self.start == 0 or self.keep is None or after - self.start >= self.keep)

    def compact(self) -> None:
        """Drop positions no block query can see any more, once ``slack`` have piled up."""
        if self.keep is None or self.held <= self.keep + self.slack:
            return
        drop = self.held - self.keep
        self.keys = mx.contiguous(self.keys[..., drop : self.held, :])
        self.values = mx.contiguous(self.values[..., drop : self.held, :])
        self.start += drop

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> list[mx.array]:
        """The held keys and values (what ``mx.eval`` needs to materialise the cache)."""
        return [] if self.keys is None else [self.keys[..., : self.held, :], self.values[..., : self.held, :]]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
