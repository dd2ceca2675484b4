"""Several requests at once: verify-and-commit cycles over the rows of a batch.

Each row is one request with its own sampler (temperature, top-p/k, seed,
logits processors, grammar), its own tokens and its own limit. A cycle drafts
one block for every row in one draft pass, verifies all rows' blocks in one
target pass over [B, b], and each row keeps its own accepted prefix plus the
target's own next token; the caches roll back per row (``targets/rows.py``:
per-row K/V lengths and masks, per-row recurrent states). b is one size for
the whole batch, chosen per cycle by the batch's policy; b = 1 is a plain
batched target step.

Rows join between cycles (``add``: the request is prefilled alone, exactly as
``SpeculativeDecoder.prefill`` does, and its caches become a new row;
``add_many``: requests arriving together, prefilled in one batch, ``batch_prefill.py``) and
leave between cycles (``remove``: its caches come back as a ``ContextCache``
holding every token it fed, for the prefix cache). A row's caches after any
sequence of cycles hold what the same request decoded alone would hold.
"""

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import mlx.core as mx

from ..draft import DFlashDraft, SubsetHead
from ..targets import Target, extend_rows
from .batch_policy import FixedRows
from .batch_prefill import prefill_together
from .decoder import NON_FINITE, ContextCache, Probe, SpeculativeDecoder
from .draft_rows import DraftRows
from .sampling import BlockSampler, log_probs
from .verify import greedy_verify


@dataclass(eq=False)
class Row:
    """One request of the batch (compared by identity)."""

    sampler: BlockSampler
    tokens: list[int]  # ids the row's caches hold
    pending: int  # y: the row's next token, chosen and not yet fed
    max_tokens: Optional[int] = None  # tokens the caller takes; None: no limit
    recent: list[int] = field(default_factory=list)  # committed tokens the logits processors may see
    emitted: int = 1  # tokens handed out: the prefill's, then each cycle's
    keep_logprobs: bool = False
    logprobs: Optional[mx.array] = None  # [n, V] at the last cycle's n tokens (keep_logprobs)
    tag: Any = None  # the caller's
    probe: Optional[Probe] = None  # drafted beside a plain step, judged against the row's next tokens
    unobserved: list = field(default_factory=list)  # its plain steps' features [1, 1, k*H], not yet injected

    def tokens_left(self) -> Optional[int]:
        return None if self.max_tokens is None else self.max_tokens - self.emitted

    def remember(self, tokens: list[int]) -> None:
        keep = self.sampler.params.context_size
        self.recent = (self.recent + tokens)[-keep:] if keep else []

    def history(self, block: mx.array) -> mx.array:
        return mx.concatenate([mx.array(self.recent, dtype=mx.int32), block])


@dataclass
class QueuedStep:
    """A plain batched step in flight: the rows it fed, each row's next token
    (argmax-only rows' in ``chosen``, others' in ``own``), processed logits,
    and the probes its tokens judge: those the rows had when it was queued
    (a probe drafted after it, from the token it makes, starts with the next)."""

    rows: list
    chosen: mx.array  # [B]
    own: dict  # id(row) -> token [1]
    processed: dict  # id(row) -> logits [1, V]
    probes: dict  # id(row) -> Probe


@dataclass
class RowCycle:
    """What one cycle committed for one row."""

    row: Row
    tokens: list[int]  # accepted drafts, then the target's own token
    accepted: int
    error: Optional[str] = None  # set: the row cannot go on (its draft's logits were not finite)


class BatchDecoder:
    """Rows joining, cycling and leaving over one set of batched caches.

    ``block_size`` is a fixed block or a policy (``batch_policy.py``) asked
    for the batch's b before each cycle and told every row's outcome.
    ``drafter`` proposes the rows' blocks (default ``DraftRows``: the draft)."""

    def __init__(self, target: Target, draft: Optional[DFlashDraft], block_size: Union[int, Any],
                 prefill_step_size: int = 2048, head: Optional[SubsetHead] = None, drafter: Any = None):
        self.target = target
        self.layer_ids = draft.config.target_layer_ids if draft is not None else [0]
        self.drafter = drafter or DraftRows(draft, target, head)
        self.make_draft_cache = draft.make_cache if draft is not None else list
        self.policy = FixedRows(block_size) if isinstance(block_size, int) else block_size
        self.prefill_step_size = prefill_step_size
        self.rows: list[Row] = []
        self.cache: list = []  # the target's, one row per request
        self.block_size = 1  # the last cycle's
        self.next_block: Optional[int] = None  # chosen at the end of the last cycle
        self.queued: Optional[QueuedStep] = None  # a plain step in flight
        self.probe_block = 0  # the block of the probe the rows are judging (0: none)
        self.probe_hits: list[list[float]] = []  # the hits of the rows whose probe is judged

    # --- rows joining and leaving -------------------------------------------------

    def add(self, prompt: mx.array, sampler: BlockSampler, max_tokens: Optional[int] = None,
            context: Optional[ContextCache] = None, logprobs: bool = False, tag: Any = None) -> tuple[Row, int]:
        """Prefill a request alone (past what ``context`` holds) and make it a
        row; returns the row and its first token."""
        if context is None:
            context = ContextCache(self.target.make_cache(), self.make_draft_cache())
        solo = SpeculativeDecoder(self.target, self.drafter.solo(context.draft), self.layer_ids, 1,
                                  self.prefill_step_size, sampler, context.target, context.tokens)
        solo.max_tokens = 1  # nothing queued after the first token: the batch takes over
        solo.keep_logprobs = logprobs
        first = solo.prefill(prompt)
        row = Row(sampler, context.tokens, first, max_tokens, solo.recent, 1, logprobs, solo.logprobs, tag)
        self._join([kind.row_cache(c) for kind, c in zip(self.target.kinds, context.target)],
                   self.drafter.rows_of([context.draft]), [row])
        return row, first

    def add_many(self, requests: list[dict]) -> list[tuple[Row, int]]:
        """``add`` for requests arriving together (each a dict of ``add``'s
        arguments), prefilled in one batch of their own (``batch_prefill.py``)."""
        target_rows, draft_rows, made = prefill_together(self, requests)
        rows = [Row(r["sampler"], tokens, first, r.get("max_tokens"), recent, 1, bool(r.get("logprobs")), logprobs,
                    r.get("tag")) for r, (tokens, first, recent, logprobs) in zip(requests, made)]
        self._join(target_rows, draft_rows, rows)
        return [(row, row.pending) for row in rows]

    def _join(self, target_rows: list, draft_rows: list, rows: list[Row]) -> None:
        if not self.rows:
            self.cache = target_rows
        else:
            for mine, theirs in zip(self.cache, target_rows):
                extend_rows(mine, theirs, len(self.rows), len(rows))
        self.drafter.join(draft_rows)
        self.rows.extend(rows)

    def remove(self, row: Row, caches: bool = True) -> Optional[ContextCache]:
        """Take ``row`` out of the batch; its caches come back, holding every
        token it fed (``row.tokens``): its draft context with its plain steps'
        positions injected. ``caches=False``: nothing is extracted or injected
        for it (a caller that keeps no caches), and None comes back."""
        r = self.rows.index(row)
        row.probe = None
        target = [c.extract(r) for c in self.cache] if caches else None
        kept = [i for i in range(len(self.rows)) if i != r]
        draft = self.drafter.leave(r, kept, row.unobserved if caches else None)
        self.rows.pop(r)
        self._probe_judged()
        if not kept:
            self.cache = []
        index = mx.array(kept, dtype=mx.int32)
        for c in self.cache:
            c.filter(index)
        return ContextCache(target, draft, row.tokens) if caches else None

    def catch_up(self) -> None:
        """Hand the drafter the plain steps' features it has not seen, every
        row's in one batch (rows that joined since have fewer: padded, then trimmed)."""
        counts = [len(row.unobserved) for row in self.rows]
        if not any(counts):
            return
        like = next(row.unobserved[0] for row in self.rows if row.unobserved)
        width = max(counts)
        features = []
        for row, n in zip(self.rows, counts):
            pad = [mx.zeros((1, width - n, like.shape[-1]), like.dtype)] if n < width else []
            features.append(mx.concatenate(row.unobserved + pad, axis=1))
            row.unobserved = []
        self.drafter.observe(mx.concatenate(features), counts)

    # --- cycles ------------------------------------------------------------------

    def choose_block(self) -> int:
        left = [r.tokens_left() for r in self.rows]
        b = self.policy.choose(self.rows)
        b = min(b, getattr(self.drafter, "widest", None) or b)  # a DSpark draft: its trained block at most
        if None not in left:  # no row takes more than its tokens left
            b = min(b, max(left))
        return max(1, b)

    def cycle(self) -> list[RowCycle]:
        """One cycle: a plain batched step (b = 1) or draft + verify, for every
        row; a plain step queued by the last cycle is this one, for its rows
        still in the batch (a row that joined since takes part from the next).

        Plain steps are pipelined as mlx-lm's own decoding runs them: while
        plain steps follow each other, the next is queued from the tokens of
        the one in flight before the host waits for them, so one always runs
        behind the host; a cycle that ends with a plain step next queues it
        before returning, so it runs while the caller handles this cycle's
        tokens. Each row's caches and ``tokens`` then already hold its
        pending token (a row removed before that step is read keeps it: its
        ``ContextCache`` holds what was fed)."""
        if self.queued is not None:
            self.block_size = 1
            step, self.next_block = self.queued, self.choose_block()
            ahead = self.next_block == 1 and all(r.tokens_left() is None or r.tokens_left() > 1 for r in self.rows)
            if ahead:  # a plain step's outcome is known before it is read: queue the next from its tokens
                self._queue_plain(self._next_tokens(step))
                self.next_block = None
            else:
                self.queued = None
            cycles = self._finish_plain(step)
            if ahead:
                self._fed(self.queued)
            return cycles
        if not self.rows:
            return []
        b = self.block_size = self.next_block or self.choose_block()
        ys = mx.array([r.pending for r in self.rows], dtype=mx.int32)
        if b == 1:
            self._queue_plain(ys)
            self._fed(self.queued)
            cycles = self._finish_plain(self.queued)
            self.queued = None
        else:
            cycles = self._speculate(ys, b)
        self.next_block = self.choose_block() if self.rows else None
        if self.next_block == 1 and all(r.tokens_left() != 0 for r in self.rows):  # no row is surely leaving
            self._queue_plain(mx.array([r.pending for r in self.rows], dtype=mx.int32))
            self._fed(self.queued)
        return cycles

    def _next_tokens(self, step: "QueuedStep") -> mx.array:
        """[B] every row's next token, unevaluated where ``step`` makes it."""
        if step.rows == self.rows and not step.own:
            return step.chosen
        index = {id(row): i for i, row in enumerate(step.rows)}
        parts = []
        for row in self.rows:
            i = index.get(id(row))
            if i is None:  # joined since: its pending token is known
                parts.append(mx.array([row.pending], dtype=mx.int32))
            else:
                parts.append(step.own[id(row)].reshape(1) if id(row) in step.own else step.chosen[i : i + 1])
        return mx.concatenate(parts)

    def _fed(self, step: "QueuedStep") -> None:
        """Once each row's pending token is known: it joins the row's ``tokens``."""
        for row in step.rows:
            row.tokens.append(row.pending)
            row.remember([row.pending])

    def _keep(self, row: Row, logits: mx.array) -> None:
        row.logprobs = log_probs(logits) if row.keep_logprobs else None

    def _start_probe(self, ys: mx.array) -> None:
        """Draft every row's block of a probe the policy has due (one at a time)."""
        due = self.policy.probe() if hasattr(self.policy, "probe") else 0
        if due < 2 or self.probe_block:
            return
        self.catch_up()
        for row, draft in zip(self.rows, self.drafter.propose(ys, due, self.rows)):
            row.probe = Probe(*draft)
            mx.async_eval(row.probe.drafted, row.probe.finite)
        self.probe_block = due

    def _judge_probe(self, row: Row, logits: mx.array) -> None:
        hits = row.probe.judge(row.pending, logits, row.sampler)
        if hits is not None:
            row.probe = None
            self.probe_hits.append(hits)
            self._probe_judged()

    def _probe_judged(self) -> None:
        """Once no row's probe waits for tokens: the rows' hits to the policy, as one outcome."""
        if self.probe_block and all(row.probe is None for row in self.rows):
            if self.probe_hits:
                self.policy.probed(self.probe_block, self.probe_hits)
            self.probe_block, self.probe_hits = 0, []

    def _drop_probe(self) -> None:
        """Speculating again: verification measures acceptance; the probe is dropped."""
        for row in self.rows:
            row.probe = None
        self.probe_block, self.probe_hits = 0, []

    def _queue_plain(self, ys: mx.array) -> None:
        """Feed every row's pending token (ys [B], maybe unevaluated) and start
        choosing the next, without waiting for it; ``_finish_plain`` reads it."""
        self._start_probe(ys)
        out = self.target.forward(ys[:, None], self.cache, self.layer_ids)
        logits = self.target.logits(out.hidden[:, -1])  # [B, V]
        chosen = mx.argmax(logits, axis=-1).astype(mx.int32)  # every argmax-only row's token, at once
        own, processed = {}, {}
        for i, row in enumerate(self.rows):
            row_logits = logits[i : i + 1]
            if not row.sampler.argmax_only:
                if row.sampler.sees_history:
                    row_logits = row.sampler.process(row_logits, row.history(ys[i : i + 1]))
                own[id(row)] = row.sampler.next_token(row_logits)
                row.sampler.commit(own[id(row)])
            processed[id(row)] = row_logits
            row.unobserved.append(out.features[i : i + 1])
        mx.async_eval(chosen, list(own.values()))
        probes = {id(row): row.probe for row in self.rows if row.probe is not None}
        self.queued = QueuedStep(list(self.rows), chosen, own, processed, probes)

    def _finish_plain(self, step: "QueuedStep") -> list[RowCycle]:
        """A queued plain step's tokens, for its rows still in the batch."""
        mx.eval(step.chosen, list(step.own.values()))
        tokens = step.chosen.tolist()
        cycles, present = [], set(self.rows)
        for row, token in zip(step.rows, tokens):
            if row not in present:  # removed since: what it fed is in its caches already
                continue
            key = id(row)
            row.pending = step.own[key].item() if key in step.own else token
            row.emitted += 1
            self._keep(row, step.processed[key])
            if row.probe is not None and step.probes.get(key) is row.probe:
                self._judge_probe(row, step.processed[key])
            cycles.append(RowCycle(row, [row.pending], 0))
        self.policy.update([c.row for c in cycles], 1, [0] * len(cycles))
        return cycles

    def _speculate(self, ys: mx.array, b: int) -> list[RowCycle]:
        self._drop_probe()
        self.catch_up()
        drafts = self.drafter.propose(ys, b, self.rows)
        block = mx.concatenate([ys[:, None], mx.stack([d for d, _, _ in drafts])], axis=1)  # [B, b]
        out = self.target.forward(block, self.cache, self.layer_ids, record=True)
        logits = self.target.logits(out.hidden)  # [B, b, V]
        greedy = greedy_verify(logits, block[:, 1:])  # every argmax-only row's verdict, at once
        own, processed = {}, []
        for i, (row, (drafted, q, _)) in enumerate(zip(self.rows, drafts)):
            row_logits = logits[i]
            if not row.sampler.argmax_only:
                row_logits = row.sampler.process(row_logits, row.history(block[i]))
                own[i] = row.sampler.verify(row_logits, drafted, q)
            processed.append(row_logits)
        finite = mx.stack([f for _, _, f in drafts])
        mx.eval(greedy, list(own.values()), block, finite)  # the one sync of the cycle
        accepted, next_tokens = (v.tolist() for v in greedy)
        for i, (a, token) in own.items():
            accepted[i], next_tokens[i] = a.item(), token.item()
        finite = finite.tolist()
        accepted = [a if ok else 0 for a, ok in zip(accepted, finite)]
        keeps = [a + 1 for a in accepted]
        self.target.rollback_rows(self.cache, out, keeps)
        self.drafter.observe(out.features, keeps)
        blocks = block.tolist()
        cycles = []
        for row, a, keep, next_token, ok, row_logits, ids in zip(
                self.rows, accepted, keeps, next_tokens, finite, processed, blocks):
            committed = ids[:keep]
            row.tokens.extend(committed)
            row.remember(committed)
            if not ok:
                cycles.append(RowCycle(row, [], 0, NON_FINITE))
                continue
            row.sampler.commit(mx.array(ids[1 : a + 1] + [next_token], dtype=mx.int32))
            row.pending = next_token
            row.emitted += keep
            self._keep(row, row_logits[:keep])
            cycles.append(RowCycle(row, committed[1:] + [row.pending], a))
        self.policy.update(self.rows, b, accepted)
        return cycles
