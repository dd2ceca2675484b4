"""Prefix reuse across requests: the decoder caches of recent requests, LRU.

A multi-turn chat re-sends its whole history, so each request's caches (the
target's KV and GatedDeltaNet states, and the draft's context cache of
injected target features) are kept after it finishes, together with the ids
they hold: the prompt and every token the decoder fed. A new prompt that
extends one of them prefills only its suffix:

- attention-only targets roll back to the longest common prefix by trimming
  every KV cache, target and draft alike;
- targets with recurrent layers (GatedDeltaNet's ``ArraysCache``) cannot be
  trimmed, so their states are snapshotted at the end of the prompt but its
  last token (the prompt is prefilled in two steps to get there): an entry is
  reused either as it is (the new prompt extends everything it holds) or
  rolled back to that snapshot (the new prompt starts with the old prompt, or
  is the same prompt again), never elsewhere.

At least one prompt token is always left to prefill, for the logits of the
first generated token. A prompt that extends an entry's prompt (all of it but
its last token, on a recurrent target) continues that conversation: the entry
is taken out of the cache and the decoder extends it in place. One that
branches off inside it (another chat with the same system prompt, a
regenerated reply) gets a copy, and the entry stays. Entries are evicted least recently used first to stay within a byte
budget. Beneath RAM, an optional disk tier (``prefix_disk.py``) keeps every
entry across restarts: where one of its files holds more of a new prompt than
RAM does, it is loaded and promoted to RAM before an entry is chosen.

With a quantized KV cache (``kv_bits``), a cache that was quantized is never
rolled back below ``quantized_kv_start`` (a fresh run attends over
full-precision keys there, so such an entry is not reused), and recurrent
states are not snapshotted (the split prefill would quantize at another pass
than a fresh run does): an entry of a recurrent target is reused only as it is.
"""

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from mlx_lm.models.cache import ArraysCache

from ..draft import DFlashDraft
from ..generate import stream_generate
from ..kv_quantization import DEFAULT_QUANTIZED_KV_START
from ..loop import ContextCache
from ..targets import Target

MAX_ENTRIES = 8


@dataclass
class Entry:
    context: ContextCache
    prompt_len: int  # where ``snapshot`` was taken
    snapshot: Optional[list]  # per target layer: an ArraysCache's arrays at prompt_len, else None
    nbytes: int
    name: str = ""  # its file in the disk tier, if any


def _common_prefix(a: list[int], b: list[int]) -> int:
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; by halves, each compared at C speed
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _resumable(tokens: list[int], prompt: list[int], prompt_len: int, recurrent: bool, snapshot: bool) -> int:
    """Tokens of ``prompt`` that caches holding ``tokens`` (recurrent states,
    if any, snapshotted at ``prompt_len`` too where ``snapshot``) hold after a
    rollback, at least one prompt token left to prefill."""
    n = _common_prefix(tokens, prompt[: len(prompt) - 1])
    if n != len(tokens) and recurrent:
        n = prompt_len if snapshot and n >= prompt_len else 0
    return n


def _nbytes(context: ContextCache, snapshot: Optional[list]) -> int:
    arrays = [a for layer in snapshot or [] for a in layer or [] if a is not None]
    return sum(c.nbytes for c in context.target + context.draft) + sum(a.nbytes for a in arrays)


class PrefixCache:
    """Decoder caches of recent requests, reusable by prompts that extend them."""

    def __init__(self, target: Target, draft: DFlashDraft, budget_bytes: int, kv: Optional[dict] = None,
                 disk=None):
        self.target = target
        self.disk = disk  # a prefix_disk.DiskTier beneath the entries, or None
        self.kv = kv or {}  # stream_generate's kv_bits, kv_group_size, quantized_kv_start
        self.draft = draft
        self.budget = budget_bytes
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()  # least recently used first
        self._next_key = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def _recurrent(self, context: ContextCache) -> bool:
        return not all(c.is_trimmable() for c in context.target)

    def _reusable(self, entry: Entry, prompt: list[int]) -> int:
        """Tokens of ``prompt`` the entry can hold after an exact rollback."""
        tokens = entry.context.tokens
        n = _resumable(tokens, prompt, entry.prompt_len, self._recurrent(entry.context), entry.snapshot is not None)
        quantized = any(hasattr(c, "bits") for c in entry.context.target)
        if quantized and n < self.kv.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START):
            n = 0  # quantized keys where a fresh run has full-precision ones
        # a sliding draft layer holds only its window: it cannot go back further
        exact = all(c.can_trim(len(tokens) - n) for c in entry.context.draft)
        return n if exact else 0

    def take(self, prompt: list[int]) -> ContextCache:
        """Caches holding the longest reusable prefix of ``prompt`` (an entry
        or a copy of one), or fresh ones; ``len(context.tokens)`` is what was reused."""
        if self.disk is not None:
            self._promote(prompt)
        best, reused = None, 0
        for key, entry in self.entries.items():
            n = self._reusable(entry, prompt)
            if n > reused:
                best, reused = key, n
        if best is None:
            return ContextCache(self.target.make_cache(), self.draft.make_cache())
        if reused >= self.entries[best].prompt_len:
            entry = self.entries.pop(best)
            context = entry.context
        else:
            entry = self.entries[best]
            self.entries.move_to_end(best)
            context = copy.deepcopy(entry.context)
        self._rollback(context, entry.snapshot, reused)
        return context

    def _promote(self, prompt: list[int]) -> None:
        """Load the disk tier's file that holds the most of ``prompt``, where
        that is more than any entry in RAM holds, into RAM."""
        held = {e.name for e in self.entries.values()}
        in_ram = max((self._reusable(e, prompt) for e in self.entries.values()), default=0)
        reusable = [(_resumable(s.tokens, prompt, s.prompt_len, s.recurrent, s.snapshot), s)
                    for s in self.disk.entries() if s.path.name not in held]
        n, stored = max(reusable, key=lambda r: r[0], default=(0, None))
        if n > in_ram and (loaded := self.disk.load(stored, self.target, self.draft)) is not None:
            context, prompt_len, snapshot = loaded
            self._add(Entry(context, prompt_len, snapshot, self.size(context, snapshot), stored.path.name))

    @staticmethod
    def _rollback(context: ContextCache, snapshot: Optional[list], n: int) -> None:
        drop = len(context.tokens) - n
        if drop == 0:
            return
        for i, c in enumerate(context.target):
            if c.is_trimmable():
                c.trim(drop)
            else:
                c.cache = list(snapshot[i])  # an ArraysCache; n is the snapshot's prompt_len
        for c in context.draft:
            c.trim(drop)
        del context.tokens[n:]

    def _snapshots(self, context: ContextCache) -> bool:
        # a recurrent cache other than an ArraysCache cannot be snapshotted: reused only as it is
        return self._recurrent(context) and all(
            c.is_trimmable() or isinstance(c, ArraysCache) for c in context.target)

    def mark(self, context: ContextCache, prompt: list[int], tokenizer) -> tuple[int, Optional[list]]:
        """Before generating from ``prompt`` with ``context`` (from ``take``):
        where ``put`` should say its recurrent states were snapshotted, and the
        snapshot. With recurrent states, that is after all of the prompt but
        its last token, prefilled here when ``context`` holds fewer: the latest
        point a later prompt, the same one included, can start from. Otherwise
        (``len(prompt)``, None), as when nothing would be kept (a zero budget)."""
        n = len(prompt) - 1
        if n == 0 or not self.budget or self.kv or not self._snapshots(context):
            return len(prompt), None
        if len(context.tokens) < n:
            # prefill to n (the token it generates is not fed); the smallest block
            # keeps the one draft pass it starts, whose proposal goes unused, cheap
            for _ in stream_generate(self.target, self.draft, tokenizer, prompt[:n], block_size=2,
                                     max_tokens=1, context=context):
                pass
        return n, [list(c.cache) if isinstance(c, ArraysCache) else None for c in context.target]

    def size(self, context: ContextCache, snapshot: Optional[list]) -> int:
        """Bytes an entry of ``context`` and ``snapshot`` counts against the budget."""
        return _nbytes(context, snapshot)

    def put(self, context: ContextCache, prompt_len: int, snapshot: Optional[list]) -> None:
        """Keep ``context`` (whose recurrent states were ``snapshot`` at
        ``prompt_len``) as the most recent entry; evict to stay in budget."""
        entry = Entry(context, prompt_len, snapshot, self.size(context, snapshot))
        if context.tokens and self._add(entry) and self.disk is not None:
            entry.name = self.disk.save(context, prompt_len, snapshot, self._recurrent(context))

    def _add(self, entry: Entry) -> bool:
        """Keep ``entry`` as the most recent, evicting to stay in budget; False if it alone is over it."""
        if entry.nbytes > self.budget:
            return False
        self.entries[self._next_key] = entry
        self._next_key += 1
        while len(self.entries) > MAX_ENTRIES or self.nbytes > self.budget:
            self.entries.popitem(last=False)
        return True

    def stats(self) -> dict:
        """What ``/health`` reports: the entries in RAM and their bytes, and the disk tier's (None: off)."""
        return {"entries": len(self.entries), "bytes": self.nbytes,
                "disk": None if self.disk is None else self.disk.stats()}

    def close(self) -> None:
        """Finish writing to the disk tier, if any."""
        if self.disk is not None:
            self.disk.close()
