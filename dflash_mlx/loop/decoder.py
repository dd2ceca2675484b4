"""The lossless block speculative loop, one cycle at a time (docs/architecture.md,
"Prefill", "Verification", "Rollback").

``SpeculativeDecoder`` owns the target cache. Each ``cycle()`` takes the proposer's b-1
tokens after the pending token y, verifies [y, d_1..d_{b-1}] in one target pass, keeps the
accepted prefix plus the target's own next token (greedy match, or rejection sampling at
temperature > 0), rolls the cache back exactly and hands the accepted positions' features
to the proposer. The host reads one small result per cycle.
"""

from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

import mlx.core as mx

from .block_policy import BlockPolicy, ConfidenceSchedule, FixedBlock
from ..draft import DFlash2Draft, DFlashDraft, DSparkDraft, SubsetHead
from ..errors import DFlashError
from ..kv_quantization import KVQuantization
from .probe import Probe
from .sampling import BlockSampler, SamplingParams, log_probs
from ..targets import Target


class Proposer(Protocol):
    """Anything that proposes block tokens: the DFlash draft, or a test oracle.

    A proposer that chooses its own drafts (DFlash2's selector walk) also has
    ``draft_block(y, block_size, sampler) -> (drafted [b-1], q [b-1, V] or
    None)``, q being the log-probabilities the drafts were drawn from; the
    others' logits go through the sampler (``propose_block``). A DDTree's node
    children that depend on its token come from ``tree_candidates`` or ``tree_rows``."""

    def observe(self, features: mx.array, tokens: mx.array) -> None:
        """Features [1, T, k*H] and ids [T] of the next T committed positions.

        A proposer that sees only the latest positions also has
        ``visible_rows() -> int or None`` and ``skip(tokens)``, told the ids
        of the prompt positions its blocks will never see instead of their
        features."""

    def propose(self, y: mx.array, block_size: int) -> mx.array:
        """Logits [b-1, V] for the b-1 tokens following token y ([1])."""


class DraftProposer:
    """Proposes with a DFlash draft that borrows the target's embedding and head
    (or, given ``head``, the head over a reduced vocabulary: ``draft/vocab.py``).

    The draft sees embeddings and logits as the target's own pass makes them
    (Gemma 4 scales the one and soft-caps the other), except where its config
    gives its own ``input_embedding_scale`` or logit scaling: the draft then
    applies that to the table's rows or the head's raw output instead, so no
    scale or cap is applied twice."""

    def __init__(self, draft: DFlashDraft, target: Target, cache: Optional[list] = None,
                 head: Optional[SubsetHead] = None):
        config = draft.config
        self.draft = draft
        self.target = target
        self.cache = draft.make_cache() if cache is None else cache
        self.mask_token_id = config.mask_token_id
        self.embed = target.embed_rows if config.input_embedding_scale != 1.0 else target.embed
        own_scaling = config.final_logit_softcapping is not None or config.output_multiplier != 1.0
        source = head or target
        self.head = source.head_logits if own_scaling else source.logits

    def observe(self, features: mx.array, tokens: mx.array) -> None:
        self.draft.inject(features, self.cache)

    def visible_rows(self) -> Optional[int]:
        """How many of the latest context positions the next block can see
        (every layer attends through a sliding window); None: all of them."""
        keeps = [c.keep for c in self.cache]
        return None if None in keeps else max(keeps)

    def skip(self, tokens: mx.array) -> None:
        """The next positions (ids [T]), which no block will see: counted, not injected."""
        for c in self.cache:
            c.skip(tokens.size)

    def propose(self, y: mx.array, block_size: int) -> mx.array:
        return self.draft.scale_logits(self.head(self.block_hidden(y, block_size)))

    def _rows(self, y: mx.array, block_size: int) -> tuple[mx.array, mx.array]:
        """(normed hidden [b-1, H], scaled logits [b-1, V]); ``finite``: ``sound_logits`` of them, lazy."""
        hidden = self.block_hidden(y, block_size)
        logits = self.draft.scale_logits(self.head(hidden))
        self.finite = sound_logits(logits)
        return hidden, logits

    def block_hidden(self, y: mx.array, block_size: int) -> mx.array:
        """The draft's normed hidden states [b-1, H] of block rows 1..b-1 after y."""
        return self.block_hidden_rows(y, block_size)[0]

    def block_hidden_rows(self, ys: mx.array, block_size: int) -> mx.array:
        """[B, b-1, H]: ``block_hidden`` of each row of a batch, after ys [B]."""
        masks = mx.full((ys.size, block_size - 1), self.mask_token_id, dtype=ys.dtype)
        block = mx.concatenate([ys[:, None], masks], axis=1)
        return self.draft(self.embed(block), self.cache)[:, 1:]


class DFlash2Proposer(DraftProposer):
    """Proposes with a DFlash2 draft: its scaled logits, and drafts chosen by
    its candidate selector's walk (``draft/selector.py``)."""

    def propose(self, y: mx.array, block_size: int) -> mx.array:
        return self._rows(y, block_size)[1]

    def draft_block(self, y: mx.array, block_size: int, sampler: BlockSampler):
        return self.walk(*self._rows(y, block_size), y, sampler)

    def walk(self, hidden: mx.array, logits: mx.array, y: mx.array, sampler: BlockSampler):
        """(drafted [b-1], q or None): the selector's walk over a block's rows
        after y, with the sampler's temperature and its next key."""
        key = sampler.draft_key()
        temperature = 0.0 if key is None else sampler.params.temperature
        return self.draft.candidate_selector.walk(hidden, logits, y, temperature, key)

    def tree_candidates(self, y: mx.array, block_size: int) -> tuple[mx.array, mx.array]:
        """For a DDTree: each depth's candidates and their log-probs after every
        parent candidate (``CandidateSelector.transitions``)."""
        return self.draft.candidate_selector.transitions(*self._rows(y, block_size), y)


def sound_logits(logits: mx.array, axis=None) -> mx.array:
    """No NaN and no +inf in ``logits`` (a scalar; per index of the axes not
    reduced, given ``axis``). -inf is sound: it marks ids a reduced drafting
    vocabulary leaves out."""
    return ~(mx.isnan(logits) | (logits == mx.inf)).any(axis=axis)


class DSparkProposer(DraftProposer):
    """Proposes with a DSpark draft (``draft/dspark.py``): slot k-1 of its
    trained-width block predicts x_k (so no more than gamma drafts), its Markov
    walk chooses them, ``confidence`` holds the walk's c_k (unevaluated), and a
    ``schedule`` (``schedule_by``; a request alone) keeps only the drafts worth verifying."""

    def __init__(self, draft: DSparkDraft, target: Target, cache: Optional[list] = None, head=None):
        super().__init__(draft, target, cache, draft.drafting_head(target, head))
        self.schedule: Optional[ConfidenceSchedule] = None
        self.widest = draft.config.block_size  # the widest block it drafts: the anchor and gamma drafts

    def schedule_by(self, costs) -> None:
        """Verify by a ``ConfidenceSchedule`` over ``costs`` (a draft with a confidence head)."""
        self.schedule = ConfidenceSchedule(costs)

    def block_hidden_rows(self, ys: mx.array, block_size: int) -> mx.array:
        return self.draft(self.embed(self.draft.block_ids(ys)), self.cache)[:, : block_size - 1]  # the trained width

    def draft_block(self, y: mx.array, block_size: int, sampler: BlockSampler):
        hidden, logits = self._rows(y, block_size)
        drafted, q, self.confidence = self.draft.walk(hidden, logits, y, sampler.draft)
        if self.schedule is not None:
            drafted, q = self.schedule.cut(drafted, q, self.confidence, self.widest - 1, self.cache[0].offset)
        return drafted, q

    def tree_rows(self, y: mx.array, block_size: int):
        """For a DDTree: base logits U [n, V] and ``z(d, token)`` [1, V] after a parent token."""
        logits = self._rows(y, block_size)[1]
        return logits, lambda d, token: self.draft.markov_z(logits[d : d + 1], mx.array([token]))


def proposer_for(draft: DFlashDraft, target: Target, cache: Optional[list] = None,
                 head: Optional[SubsetHead] = None) -> DraftProposer:
    """The proposer of a draft's architecture (v1, DFlash2 or DSpark)."""
    kinds = ((DSparkDraft, DSparkProposer), (DFlash2Draft, DFlash2Proposer))
    cls = next((proposer for kind, proposer in kinds if isinstance(draft, kind)), DraftProposer)
    return cls(draft, target, cache, head)


def propose_block(proposer: Proposer, y: mx.array, block_size: int, sampler: BlockSampler):
    """(drafted [b-1] int32, q or None, finite): the proposer's own choice where
    it makes one, else the sampler's from its logits; ``finite`` is a scalar,
    false when the draft's logits hold NaN or +inf (a proposer that chooses its
    own drafts says so in its ``finite`` after ``draft_block``; else true)."""
    own = getattr(proposer, "draft_block", None)
    if own:
        drafted, q = own(y, block_size, sampler)
        return drafted, q, getattr(proposer, "finite", mx.array(True))
    logits = proposer.propose(y, block_size)
    return *sampler.draft(logits), sound_logits(logits)


def prefill_chunks(begin: int, end: int, step: int) -> list[tuple[int, int]]:
    """The (start, stop) chunks of prompt positions begin..end as mlx-lm's
    ``generate_step`` feeds them: all but the last position ``step`` at a
    time, then the last one alone."""
    stop = end - 1 if end - begin > 1 else end
    chunks = [(s, min(s + step, stop)) for s in range(begin, stop, step)]
    return chunks + ([(stop, end)] if stop < end else [])


NON_FINITE = ("the draft produced non-finite logits (NaN or inf), so generation stopped; "
              "run it in float32 (--draft-dtype float32, or load_draft(..., dtype='float32'))")


@dataclass
class ContextCache:
    """A target cache and the draft's context cache that both hold ``tokens``.

    Handed to ``stream_generate(context=...)``, it is continued from (only the
    prompt past ``tokens`` is prefilled) and updated in place: afterwards it
    holds every token the decoder fed, so a caller can keep it for the next
    prompt that extends them.
    """

    target: list
    draft: list
    tokens: list[int] = field(default_factory=list)


@dataclass
class Cycle:
    tokens: list[int]  # committed this cycle: accepted drafts, then the target's token
    accepted: int  # how many drafted tokens were accepted


class SpeculativeDecoder:
    """Prefill, then verify-and-commit cycles over one target cache.

    ``block_size`` is a fixed block or a ``BlockPolicy``, asked for b before
    each block is drafted and told each cycle's outcome; b = 1 drafts nothing
    and the cycle is a plain target step. ``kv`` quantizes the target's
    attention caches as mlx-lm does (``kv_quantization.py``).
    """

    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        layer_ids: list[int],
        block_size: Union[int, BlockPolicy],
        prefill_step_size: int = 2048,
        sampler: Optional[BlockSampler] = None,
        cache: Optional[list] = None,
        tokens: Optional[list[int]] = None,
        kv: Optional[KVQuantization] = None,
    ):
        self.target = target
        self.kv = kv
        self.proposer = proposer
        self.layer_ids = layer_ids
        fixed = isinstance(block_size, int)
        self.policy: BlockPolicy = FixedBlock(block_size) if fixed else block_size
        self.block_size: Optional[int] = block_size if fixed else None  # the queued draft's block
        self.prefill_step_size = prefill_step_size
        self.sampler = sampler or BlockSampler(SamplingParams())
        q = None if self.sampler.greedy else mx.zeros((0, target.vocab_size), dtype=mx.float32)
        self.no_draft = (mx.zeros((0,), dtype=mx.int32), q)  # the "proposal" of a plain step
        self.cache = target.make_cache() if cache is None else cache
        self.tokens = [] if tokens is None else tokens  # ids the cache holds, extended in place
        self.recent: list[int] = []  # committed tokens the logits processors may see
        self.pending: Optional[mx.array] = None  # y: chosen but not yet fed to the target
        self.drafted: Optional[mx.array] = None  # the proposal after y, already queued
        self.queued: Optional[mx.array] = None  # b = 1: the token after y, its step already queued
        self.unobserved: list[tuple[mx.array, mx.array]] = []  # plain steps' features and ids, not yet injected
        self.draft_logprobs: Optional[mx.array] = None  # q, when sampling
        self.draft_finite = mx.array(True)  # whether the queued draft's logits were finite
        self.keep_logprobs = False  # set True: ``logprobs`` carries the committed tokens' log-probabilities
        self.max_tokens: Optional[int] = None  # set: the tokens the caller takes (``tokens_left``)
        self.emitted = 0  # tokens handed out: the prefill's first, then each cycle's
        self.logprobs: Optional[mx.array] = None  # [n, V] at the last prefill's or cycle's n tokens (lazy)
        self.queued_logits: Optional[mx.array] = None  # b = 1: the processed logits of ``queued``
        self.probe: Optional[Probe] = None  # drafted beside a plain step, judged against the next tokens

    def _keep(self, logits: mx.array) -> None:
        """With ``keep_logprobs``: ``log_probs`` of processed logits [n, V]."""
        self.logprobs = log_probs(logits) if self.keep_logprobs else None

    def _remember(self, tokens: list[int]) -> None:
        keep = self.sampler.params.context_size
        self.recent = (self.recent + tokens)[-keep:] if keep else []

    def prefill(self, prompt: mx.array) -> int:
        """Feed the prompt past the ``tokens`` the cache already holds (its
        prefix) in mlx-lm's chunks (``prefill_chunks``); return the first
        generated token.

        As in mlx-lm's prefill, a chunk before the last token evaluates only
        what the caches hold, so the layers past the last cached projection
        (the last layer's attention and MLP, the final norm) never run on it:
        only the last token's pass makes hidden states. Each chunk's rows are
        injected into the draft's context with its own pass (about 2% of the
        prefill on the demo pair), so no features are held past their chunk and
        the first draft pass owes nothing."""
        for start, stop in prefill_chunks(len(self.tokens), prompt.size, self.prefill_step_size):
            chunk = prompt[start:stop]
            self._quantize_kv()
            out = self.target.forward(chunk[None], self.cache, self.layer_ids)
            self._observe_prompt(out.features, chunk, start, prompt.size)
            mx.eval([c.state for c in self.cache], [c.state for c in getattr(self.proposer, "cache", None) or []])
            mx.clear_cache()
        self.tokens.extend(prompt[len(self.tokens) :].tolist())
        self._remember(prompt.tolist())
        logits = self.target.logits(out.hidden[:, -1])
        logits = self.sampler.process(logits, mx.array(self.recent, dtype=mx.int32))
        self._keep(logits)
        self.pending = self.sampler.next_token(logits)
        self.sampler.commit(self.pending)
        first = self.pending.item()
        self.emitted = 1
        self._queue_next()
        return first

    def _observe_prompt(self, features: mx.array, chunk: mx.array, start: int, end: int) -> None:
        """Hand the proposer a prompt chunk's rows (positions start..): only
        those its next block can still see at the prompt's ``end`` (a draft
        whose layers all attend through sliding windows), the others skipped."""
        visible = getattr(self.proposer, "visible_rows", None)
        rows = visible() if visible else None
        skip = 0 if rows is None else min(max(end - rows - start, 0), chunk.size)
        if skip:
            self.proposer.skip(chunk[:skip])
        if skip < chunk.size:
            self.proposer.observe(features[:, skip:], chunk[skip:])

    def tokens_left(self) -> Optional[int]:
        """Tokens the caller will still take (None: no limit set): the next
        cycle never drafts past them, and none is queued once it is 0."""
        return None if self.max_tokens is None else self.max_tokens - self.emitted

    def _queue_draft(self) -> None:
        # start drafting the next block while the host streams this cycle's text
        left = self.tokens_left()
        self.block_size = self.policy.choose(len(self.tokens), left)
        if self.kv:
            self.block_size = self.kv.block(len(self.tokens), self.block_size)
        self.block_size = min(self.block_size, getattr(self.proposer, "widest", self.block_size))  # DSpark: trained
        if left is not None:  # a cycle emits at most b tokens
            self.block_size = max(1, min(self.block_size, left))
        if self.block_size == 1:  # speculation off: a plain target step, no draft pass
            self.drafted, self.draft_logprobs = self.no_draft
            self.draft_finite = mx.array(True)
            self._start_probe()
            return
        self.probe = None  # speculating again: verification measures acceptance
        self.catch_up()
        self.drafted, self.draft_logprobs, self.draft_finite = propose_block(
            self.proposer, self.pending, self.block_size, self.sampler)
        mx.async_eval(self.drafted, self.draft_finite)

    def _start_probe(self) -> None:
        """Draft the block of a probe the policy has due (one at a time)."""
        due = getattr(self.policy, "probe", None)
        if due is None or self.probe is not None:
            return
        b = due()
        if b < 2:
            return
        self.catch_up()
        self.probe = Probe(*propose_block(self.proposer, self.pending, b, self.sampler))
        mx.async_eval(self.probe.drafted, self.probe.finite)

    def _judge_probe(self, probe: Probe, token: int, logits: mx.array) -> None:
        hits = probe.judge(token, logits, self.sampler)
        if hits is not None:
            self.policy.probed(probe.drafted.size + 1, hits)
            if self.probe is probe:
                self.probe = None

    def _queue_next(self) -> None:
        # the next cycle's work, started while the host streams this cycle's text
        if self.tokens_left() == 0:  # the caller takes no more: nothing to start
            return
        self._queue_draft()
        if self.block_size == 1:
            self._queue_plain_step()

    def _quantize_kv(self) -> None:
        """Before a target pass: quantize the caches mlx-lm's would have by now."""
        if self.kv:
            self.kv.convert(self.cache, self.target.kinds)

    def catch_up(self) -> None:
        """Hand the proposer the features of the plain steps it has not seen,
        in one batch (they wait until it next drafts, or generation ends)."""
        if self.unobserved:
            features, ids = zip(*self.unobserved)
            self.proposer.observe(mx.concatenate(features, axis=1), mx.concatenate(ids))
            self.unobserved = []

    def close(self) -> None:
        """Leave the proposer's cache holding every fed token (``ContextCache``)."""
        self.catch_up()

    def _queue_plain_step(self) -> None:
        """Feed y alone (the layers' own forward, nothing to roll back) and
        start computing the token after it before waiting for y itself, as
        mlx-lm's own decoding does: while plain steps follow each other, one is
        always in flight behind the host. y joins ``tokens`` here, so the cache
        and ``tokens`` agree whenever a cycle or the prefill returns (the
        prefill queues the first step, as mlx-lm's does)."""
        y = self.pending
        self._quantize_kv()
        out = self.target.forward(y[None], self.cache, self.layer_ids)
        self.unobserved.append((out.features, y))
        logits = self.target.logits(out.hidden[:, -1])
        if self.sampler.sees_history:
            logits = self.sampler.process(logits, mx.concatenate([mx.array(self.recent, dtype=mx.int32), y]))
        self.queued = self.sampler.next_token(logits)
        self.sampler.commit(self.queued)
        self.queued_logits = logits
        mx.async_eval(self.queued)
        committed = [y.item()]  # waits only while the step that makes y still runs
        self.tokens.extend(committed)
        self._remember(committed)

    def cycle(self) -> Cycle:
        """One draft + verify + commit cycle; returns the committed tokens."""
        if self.block_size == 1:  # a plain step: nothing drafted, so nothing to reject
            self.pending, self.queued = self.queued, None
            logits, probe = self.queued_logits, self.probe  # a probe drafted before this token
            self._keep(logits)
            self.policy.update(1, 0)
            self.emitted += 1
            self._queue_next()
            token = self.pending.item()
            if probe is not None:
                self._judge_probe(probe, token, logits)
            return Cycle([token], 0)
        y, drafted = self.pending, self.drafted
        block = mx.concatenate([y, drafted])
        self._quantize_kv()
        out = self.target.forward(block[None], self.cache, self.layer_ids, record=True)
        history = mx.concatenate([mx.array(self.recent, dtype=mx.int32), block])
        logits = self.sampler.process(self.target.logits(out.hidden)[0], history)
        accepted, next_token = self.sampler.verify(logits, drafted, self.draft_logprobs)
        mx.eval(accepted, next_token, drafted, self.draft_finite)  # the one sync of the cycle
        if not self.draft_finite.item():
            # drafts from NaN logits: keep only y (the target's own token, already
            # emitted) so the caches stay consistent, and emit nothing chosen after it
            self.target.rollback(self.cache, out, 1)
            self.proposer.observe(out.features[:, :1], block[:1])
            self.tokens.append(y.item())
            raise DFlashError(NON_FINITE)
        a = accepted.item()
        self._keep(logits[: a + 1])
        self.policy.update(block.size, a)
        committed = block[: a + 1].tolist()
        self.target.rollback(self.cache, out, a + 1)
        self.proposer.observe(out.features[:, : a + 1], block[: a + 1])
        self.tokens.extend(committed)
        self._remember(committed)
        self.sampler.commit(mx.concatenate([drafted[:a], next_token]))
        self.pending = next_token
        self.emitted += a + 1
        self._queue_next()
        return Cycle(committed[1:] + [next_token.item()], a)
