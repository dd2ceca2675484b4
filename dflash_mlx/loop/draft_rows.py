"""Every row's block of a batch drafted in one pass of the draft (``loop/batch.py``)."""

from typing import Optional

import mlx.core as mx

from ..draft import DFlashDraft, DraftContextCache, SubsetHead
from ..targets import RowKVCache, Target
from .decoder import DFlash2Proposer, DSparkProposer, Proposer, proposer_for, sound_logits


class DraftRows:
    """Drafts every row's block in one pass of the DFlash draft over per-row
    context caches (``targets/rows.py``'s ``RowKVCache``, each row at its own
    position), with the target's embedding and head as a request alone has them.
    A DSpark draft's pass runs its trained-width block; ``widest`` (its
    ``config.block_size``) is the widest block it drafts, None for the others."""

    def __init__(self, draft: DFlashDraft, target: Target, head: Optional[SubsetHead] = None):
        self.draft, self.target, self.head = draft, target, head
        self.proposer = proposer_for(draft, target, [], head)  # its cache: one RowKVCache per draft layer
        self.widest = getattr(self.proposer, "widest", None)

    def solo(self, cache: list) -> Proposer:
        """The proposer a request's prefill injects its prompt through."""
        return proposer_for(self.draft, self.target, cache, self.head)

    @staticmethod
    def rows_of(caches: list[list[DraftContextCache]]) -> list[RowKVCache]:
        """Requests' draft context caches (one list per request) as the rows of batch caches."""
        out = None
        for cache in caches:
            rows = [RowKVCache(*c.state, lengths=[c.held], starts=[c.start]) if c.held
                    else RowKVCache(lengths=[0], starts=[c.offset]) for c in cache]
            if out is None:
                out = rows
            else:
                for mine, theirs in zip(out, rows):
                    mine.extend(theirs)
        return out

    def join(self, rows: list[RowKVCache]) -> None:
        """Append rows (``rows_of``) to the batch's draft context."""
        if not self.proposer.cache:
            self.proposer.cache = rows
        else:
            for mine, theirs in zip(self.proposer.cache, rows):
                mine.extend(theirs)

    def leave(self, r: int, kept: list[int], unobserved: Optional[list] = None) -> Optional[list[DraftContextCache]]:
        """Row r's caches as a request's own, with its ``unobserved`` plain
        steps' features (each [1, 1, k*H]) injected (None: its caches are not
        wanted); the batch keeps rows ``kept``."""
        out = None
        if unobserved is not None:
            fresh = self.draft.make_cache()
            out = [DraftContextCache.from_row(*c.row(r), keep=f.keep) for c, f in zip(self.proposer.cache, fresh)]
            if unobserved:
                self.draft.inject(mx.concatenate(unobserved, axis=1), out)
        for c in self.proposer.cache:
            c.filter(mx.array(kept, dtype=mx.int32))
        if not kept:
            self.proposer.cache = []
        return out

    def observe(self, features: mx.array, counts: list[int], rows: Optional[list[RowKVCache]] = None) -> None:
        """Inject features [B, T, k*H], of which row r keeps its first
        ``counts[r]``, into the batch's draft context (or into ``rows``)."""
        rows = self.proposer.cache if rows is None else rows
        self.draft.inject(features, rows)
        T = features.shape[1]
        for c in rows:
            c.trim_rows([T - n for n in counts])

    def propose(self, ys: mx.array, block_size: int, rows: list) -> list[tuple]:
        """Every row's (drafted [b-1], q or None, finite) after ys [B]."""
        proposer = self.proposer
        hidden = proposer.block_hidden_rows(ys, block_size)  # [B, b-1, H]
        logits = self.draft.scale_logits(proposer.head(hidden))
        # argmax-only rows' drafts, every row's at once (unevaluated where no row uses them), as a request alone drafts
        if isinstance(proposer, DFlash2Proposer):  # the candidate selector's walk
            greedy = self.draft.candidate_selector.greedy_walk(hidden, logits, ys)
        elif isinstance(proposer, DSparkProposer):  # the Markov walk; no confidence schedule
            greedy = self.draft.greedy_walk(logits, ys)
        else:
            greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        sound = sound_logits(logits, axis=(1, 2))  # per row
        drafts = []
        for i, row in enumerate(rows):
            if row.sampler.argmax_only:
                drafted, q = greedy[i], None
            elif isinstance(proposer, DSparkProposer):  # each other row's own walk and sampler
                drafted, q, _ = self.draft.walk(hidden[i], logits[i], ys[i : i + 1], row.sampler.draft)
            elif isinstance(proposer, DFlash2Proposer):
                drafted, q = proposer.walk(hidden[i], logits[i], ys[i : i + 1], row.sampler)
            else:
                drafted, q = row.sampler.draft(logits[i])
            drafts.append((drafted, q, sound[i]))
        return drafts
