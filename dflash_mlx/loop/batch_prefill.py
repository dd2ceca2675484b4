"""Requests arriving together, prefilled in one batch of their own
(``BatchDecoder.add_many``), as mlx-lm's batch generator prefills its prompts.

Each request's prompt past what its context holds is fed as a request alone
feeds it (``prefill_chunks``): all of it but its last token, in chunks, then
its last token alone, here for every request at once. The requests' rest
lengths differ, so the chunks are right-padded: attention rows (``RowKVCache``)
write every slot and keep only their own (the padding is trimmed after the
chunk, and causality hides it from the valid queries); GatedDeltaNet rows are
told each row's length for the chunk (mlx-lm's ``ArraysCache.prepare``), so a
state stops where its row does and a row with nothing left in a chunk keeps
its state and convolution window. The draft's context rows take each row's
own features the same way.
"""

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..targets import extend_rows
from .decoder import ContextCache
from .sampling import log_probs


def _pad(rows: list[list[int]], width: int) -> mx.array:
    return mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)


def _feed(decoder, cache: list, draft_rows, chunk: list[list[int]]) -> mx.array:
    """One right-padded pass over every row's ``chunk`` ids; the hidden states [B, T, H]."""
    width = max(map(len, chunk))
    counts = [len(ids) for ids in chunk]
    recurrent = [c for c in cache if isinstance(c, ArraysCache)]
    for c in recurrent:
        c.prepare(lengths=counts)
    out = decoder.target.forward(_pad(chunk, width), cache, decoder.layer_ids)
    for c in recurrent:
        c.finalize()
    for c in cache:
        if not isinstance(c, ArraysCache):
            c.trim_rows([width - n for n in counts])
    decoder.drafter.observe(out.features, counts, draft_rows)
    return out.hidden


def prefill_together(decoder, requests: list[dict]) -> tuple[list, list, list[tuple]]:
    """(the requests' target caches and draft context rows, as batch caches
    of their own, and per request: the ids its caches hold, its first token,
    the tokens its logits processors see, its log-probabilities or None)."""
    contexts = [r.get("context") or ContextCache(decoder.target.make_cache(), decoder.make_draft_cache())
                for r in requests]
    kinds = decoder.target.kinds
    cache = None
    for i, context in enumerate(contexts):
        rows = [kind.row_cache(c) for kind, c in zip(kinds, context.target)]
        if cache is None:
            cache = rows
        else:
            for mine, theirs in zip(cache, rows):
                extend_rows(mine, theirs, i, 1)
    draft_rows = decoder.drafter.rows_of([c.draft for c in contexts])
    prompts = [r["prompt"].tolist() for r in requests]
    rests = [p[len(c.tokens):] for p, c in zip(prompts, contexts)]
    step = decoder.prefill_step_size
    body = max(len(r) for r in rests) - 1
    for start in range(0, body, step):  # the chunks a request alone feeds (``prefill_chunks``)
        stop = min(start + step, body)
        _feed(decoder, cache, draft_rows, [r[: len(r) - 1][start:stop] for r in rests])
        mx.eval([c.state for c in cache], [c.state for c in draft_rows or []])
        mx.clear_cache()
    hidden = _feed(decoder, cache, draft_rows, [r[-1:] for r in rests])
    logits = decoder.target.logits(hidden[:, -1])  # [B, V]
    made = []
    for i, (request, prompt, context) in enumerate(zip(requests, prompts, contexts)):
        sampler = request["sampler"]
        context.tokens.extend(prompt[len(context.tokens):])
        keep = sampler.params.context_size
        recent = prompt[-keep:] if keep else []
        row_logits = sampler.process(logits[i : i + 1], mx.array(recent, dtype=mx.int32))
        first = sampler.next_token(row_logits)
        sampler.commit(first)
        logprobs = log_probs(row_logits) if request.get("logprobs") else None
        made.append((context.tokens, first.item(), recent, logprobs))
    return cache, draft_rows, made
