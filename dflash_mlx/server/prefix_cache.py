"""Prefix reuse across requests: the decoder caches of recent requests, LRU.

A multi-turn chat re-sends its whole history, so each request's caches (the
target's KV and GatedDeltaNet states, and the draft's context cache of
injected target features) are kept after it finishes, together with the ids
they hold: the prompt and every token the decoder fed. A new prompt that
extends one of them prefills only its suffix:

- attention-only targets roll back to the longest common prefix by trimming
  every KV cache, target and draft alike;
- targets with recurrent layers (GatedDeltaNet's ``ArraysCache``) cannot be
  trimmed, so their states are checkpointed while the prompt is prefilled
  (in steps, to get there): at the start of the chat template's last turn,
  every ``interval`` tokens and at the end of the prompt but its last token
  (``prefix_checkpoints.py``). An entry is reused either as it is (the new
  prompt extends everything it holds) or rolled back to the last checkpoint
  at or before the point where the prompts part, never elsewhere.

At least one prompt token is always left to prefill, for the logits of the
first generated token. A prompt that extends an entry's prompt (all of it but
its last token, on a recurrent target) continues that conversation: the entry
is taken out of the cache and the decoder extends it in place. One that
branches off inside it (another chat with the same system prompt, a
regenerated reply) gets a copy, and the entry stays. Entries, checkpoints
included, are evicted least recently used first to stay within a byte
budget. What each request reused, and from which tier, is counted for
``/health``. Beneath RAM, an optional disk tier (``prefix_disk.py``) keeps every
entry across restarts: where one of its files holds more of a new prompt than
RAM does, it is loaded and promoted to RAM before an entry is chosen.

A prompt with images is compared by its key (``VisionTarget.key``): its ids
expanded per image, each image's rows replaced by an id derived from the
SHA-256 of its bytes, so the same text with another image shares only the
text before it. Its entries stay in RAM.

With a quantized KV cache (``kv_bits``), a cache that was quantized is never
rolled back below ``quantized_kv_start`` (a fresh run attends over
full-precision keys there, so such an entry is not reused), and recurrent
states are not checkpointed (the split prefill would quantize at another pass
than a fresh run does): an entry of a recurrent target is reused only as it is.
"""

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from mlx_lm.models.cache import ArraysCache

from ..draft import DFlashDraft
from ..generate import stream_generate
from ..kv_quantization import DEFAULT_QUANTIZED_KV_START
from ..loop import ContextCache
from ..targets import Target
from .prefix_checkpoints import DEFAULT_INTERVAL, Checkpoint, nbytes, positions, resumable

MAX_ENTRIES = 8
TIERS = ("ram", "disk")


@dataclass
class Entry:
    context: ContextCache
    prompt_len: int  # where its prompt ends (all of it but its last token, where checkpointed)
    checkpoints: list[Checkpoint]  # its recurrent states, ascending, the last at prompt_len; [] if none
    nbytes: int
    key: Optional[list[int]] = None  # its tokens as prompts are compared, where they hold images; None: its tokens
    name: str = ""  # its file in the disk tier, if any
    tier: str = "ram"  # "disk" from its loading to its first use


@dataclass
class Resume:
    """What ``PrefixCache.resume`` found for a prompt."""

    context: ContextCache  # ``len(context.tokens)`` is what was reused
    checkpoints: list[Checkpoint] = field(default_factory=list)  # its entry's, at or before that
    tier: Optional[str] = None  # where they came from: "ram", "disk", or None (nothing reused)


def _nbytes(context: ContextCache, checkpoints: list[Checkpoint]) -> int:
    return sum(c.nbytes for c in context.target + context.draft) + nbytes(checkpoints)


class PrefixCache:
    """Decoder caches of recent requests, reusable by prompts that extend them."""

    def __init__(self, target: Target, draft: DFlashDraft, budget_bytes: int, kv: Optional[dict] = None,
                 disk=None, interval: int = DEFAULT_INTERVAL):
        self.target = target
        self.disk = disk  # a prefix_disk.DiskTier beneath the entries, or None
        self.kv = kv or {}  # stream_generate's kv_bits, kv_group_size, quantized_kv_start
        self.draft = draft
        self.budget = budget_bytes
        self.interval = interval  # a recurrent checkpoint every this many prompt tokens (0: none)
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()  # least recently used first
        self._next_key = 0
        self.hits = dict.fromkeys(TIERS, 0)  # requests that reused caches, by tier
        self.saved = dict.fromkeys(TIERS, 0)  # prompt tokens they did not prefill, by tier
        # whether prompts' recurrent states are checkpointed (a hybrid target, entries
        # kept, no quantized KV): then marks such as a chat's last turn are worth finding
        self.checkpointing = bool(budget_bytes) and not self.kv and self._snapshots(
            ContextCache(target.make_cache(), []))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def _recurrent(self, context: ContextCache) -> bool:
        return not all(c.is_trimmable() for c in context.target)

    def _reusable(self, entry: Entry, prompt: list[int]) -> int:
        """Tokens of ``prompt`` (as compared: see ``resume``) the entry can hold after an exact rollback."""
        tokens = entry.context.tokens if entry.key is None else entry.key
        n = resumable(tokens, prompt, [c.position for c in entry.checkpoints], self._recurrent(entry.context))
        quantized = any(hasattr(c, "bits") for c in entry.context.target)
        if quantized and n < self.kv.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START):
            n = 0  # quantized keys where a fresh run has full-precision ones
        # a sliding draft layer holds only its window: it cannot go back further
        exact = all(c.can_trim(len(tokens) - n) for c in entry.context.draft)
        return n if exact else 0

    def resume(self, prompt: list[int]) -> Resume:
        """Caches holding the longest reusable prefix of ``prompt`` (an entry
        or a copy of one) or fresh ones, with the checkpoints they keep and
        the tier they came from. A prompt with images is given as its
        ``VisionTarget.key``: an image's rows match only the same image's."""
        if self.disk is not None:
            self._promote(prompt)
        best, reused = None, 0
        for key, entry in self.entries.items():
            n = self._reusable(entry, prompt)
            if n > reused:
                best, reused = key, n
        if best is None:
            return Resume(ContextCache(self.target.make_cache(), self.draft.make_cache()))
        if reused >= self.entries[best].prompt_len:
            entry = self.entries.pop(best)
            context = entry.context
        else:
            entry = self.entries[best]
            self.entries.move_to_end(best)
            context = copy.deepcopy(entry.context)
        self._rollback(context, entry.checkpoints, reused)
        tier, entry.tier = entry.tier, "ram"
        self.hits[tier] += 1
        self.saved[tier] += reused
        return Resume(context, [c for c in entry.checkpoints if c.position <= reused], tier)

    def _promote(self, prompt: list[int]) -> None:
        """Load the disk tier's file that holds the most of ``prompt``, where
        that is more than any entry in RAM holds, into RAM."""
        held = {e.name for e in self.entries.values()}
        in_ram = max((self._reusable(e, prompt) for e in self.entries.values()), default=0)
        reusable = [(resumable(s.tokens, prompt, s.checkpoints, s.recurrent), s)
                    for s in self.disk.entries() if s.path.name not in held]
        n, stored = max(reusable, key=lambda r: r[0], default=(0, None))
        if n > in_ram and (loaded := self.disk.load(stored, self.target, self.draft)) is not None:
            context, prompt_len, checkpoints = loaded
            self._add(Entry(context, prompt_len, checkpoints, self.size(context, checkpoints), None,
                            stored.path.name, "disk"))

    @staticmethod
    def _rollback(context: ContextCache, checkpoints: list[Checkpoint], n: int) -> None:
        drop = len(context.tokens) - n
        if drop == 0:
            return
        states = next((c.states for c in checkpoints if c.position == n), None)
        for i, c in enumerate(context.target):
            if c.is_trimmable():
                c.trim(drop)
            else:
                c.cache = list(states[i])  # an ArraysCache, checkpointed at n
        for c in context.draft:
            c.trim(drop)
        del context.tokens[n:]

    def _snapshots(self, context: ContextCache) -> bool:
        # a recurrent cache other than an ArraysCache cannot be snapshotted: reused only as it is
        return self._recurrent(context) and all(
            c.is_trimmable() or isinstance(c, ArraysCache) for c in context.target)

    def mark(self, context: ContextCache, prompt: list[int], tokenizer, marks: list[int] = (),
             kept: list[Checkpoint] = (), target: Optional[Target] = None) -> tuple[int, list[Checkpoint]]:
        """Before generating from ``prompt`` with ``context`` (from ``resume``,
        whose ``kept`` checkpoints it keeps): where ``put`` should say the
        prompt ends, and the checkpoints of its recurrent states, prefilled
        here to each in turn: ``marks`` (the start of a chat's last turn),
        every ``interval`` tokens, and all of the prompt but its last token,
        the latest point a later prompt, the same one included, can start
        from. Without recurrent states (or entries to keep, or with quantized
        KV), (``len(prompt)``, []). ``target`` prefills (a ``VisionTarget``
        where the prompt holds images); None: this cache's."""
        end = len(prompt) - 1
        if end == 0 or not self.checkpointing:
            return len(prompt), []
        checkpoints = list(kept)
        for p in positions(end, len(context.tokens), self.interval, list(marks)):
            if any(c.position == p for c in checkpoints):
                continue  # resumed at the end of this very prompt
            if len(context.tokens) < p:
                # prefill to p (the token it generates is not fed); the smallest block
                # keeps the one draft pass it starts, whose proposal goes unused, cheap
                for _ in stream_generate(target or self.target, self.draft, tokenizer, prompt[:p], block_size=2,
                                         max_tokens=1, context=context):
                    pass
            checkpoints.append(Checkpoint(p, [list(c.cache) if isinstance(c, ArraysCache) else None
                                              for c in context.target]))
        return end, checkpoints

    def size(self, context: ContextCache, checkpoints: list[Checkpoint]) -> int:
        """Bytes an entry of ``context`` and ``checkpoints`` counts against the budget."""
        return _nbytes(context, checkpoints)

    def put(self, context: ContextCache, prompt_len: int, checkpoints: list[Checkpoint],
            key: Optional[list[int]] = None) -> None:
        """Keep ``context`` (whose prompt ends at ``prompt_len``, its recurrent
        states at ``checkpoints``) as the most recent entry; evict to stay in
        budget. ``key``: the prompt as compared, where it holds images (see
        ``resume``); such an entry stays off the disk tier, whose files hold tokens alone."""
        tokens = context.tokens
        keyed = None if key is None else (list(key) + tokens[len(key):])[: len(tokens)]
        entry = Entry(context, prompt_len, checkpoints, self.size(context, checkpoints), keyed)
        if tokens and self._add(entry) and self.disk is not None and key is None:
            entry.name = self.disk.save(context, prompt_len, checkpoints, self._recurrent(context))

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
        """What ``/health`` reports per tier: entries (and RAM's checkpoints),
        bytes, requests that reused caches from it and the prompt tokens they
        did not prefill; ``disk`` is None where there is no disk tier."""
        served = {tier: {"hits": self.hits[tier], "tokens_saved": self.saved[tier]} for tier in TIERS}
        checkpoints = sum(len(e.checkpoints) for e in self.entries.values())
        return {"entries": len(self.entries), "checkpoints": checkpoints, "bytes": self.nbytes, **served["ram"],
                "disk": None if self.disk is None else self.disk.stats() | served["disk"]}

    def close(self) -> None:
        """Finish writing to the disk tier, if any."""
        if self.disk is not None:
            self.disk.close()
