"""``batch_generate``: several prompts decoded together with DFlash, each row
joining when a slot is free and leaving when it ends (``loop/batch.py``)."""

from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import validate
from .draft import DFlashDraft, subset_head
from .errors import DFlashError
from .generate import (SAMPLING, GenerationResult, check_pair, drained, encode_prompt, ending, keywords,
                       request_sampler)
from .loop import BatchDecoder, batch_policy
from .targets import Target, check_forward


@keywords(*SAMPLING, "response_format")
def batch_generate(
    model: Union[nn.Module, Target],
    draft: DFlashDraft,
    tokenizer,
    prompts: list,
    max_tokens: Union[int, list[int]] = 256,
    block_size: Union[int, str, None] = "auto",
    max_concurrency: Optional[int] = None,
    sampling: Optional[list[dict]] = None,
    prefill_step_size: int = 2048,
    draft_vocab: Optional[int] = None,
    **shared,
) -> list[GenerationResult]:
    """Generate for every prompt with DFlash, decoding up to ``max_concurrency``
    of them at once (default: all): one result per prompt, in order, each
    exactly what ``generate`` gives for that prompt alone (the target's own
    greedy tokens, or its own sampling distribution). ``max_tokens`` is one
    limit or one per prompt; ``shared`` holds sampling arguments for every
    prompt (``temperature``, ``top_p``, ``seed``, ...), and ``sampling[i]``
    overrides them for prompt i (``response_format`` too: each row its own grammar). ``block_size``: as ``stream_generate``'s,
    chosen for the whole batch each cycle (``loop/batch_policy.py``).
    ``draft_vocab``: as ``stream_generate``'s, for every row."""
    target = model if isinstance(model, Target) else Target(model)
    check_pair(target, draft)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    n = len(prompts)
    limits = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    overrides = sampling or [{}] * n
    if len(limits) != n or len(overrides) != n:
        raise DFlashError(f"batch_generate() takes one max_tokens and one sampling entry per prompt ({n})")
    for limit in limits:
        validate.options({"max_tokens": limit})
    validate.options({"prefill_step_size": prefill_step_size, "draft_vocab": draft_vocab})
    head = None if draft_vocab is None else subset_head(target, draft.vocab_ranking, draft_vocab)
    width = n if max_concurrency is None else max_concurrency
    if width < 1:
        raise DFlashError(f"max_concurrency must be >= 1, got {width}")
    samplers = [request_sampler(tokenizer, target.vocab_size, **{**shared, **extra}) for extra in overrides]
    ids = [encode_prompt(tokenizer, p, target.vocab_size) for p in prompts]
    for prompt in ids:
        validate.prompt_length(prompt.size, getattr(target.args, "max_position_embeddings", None))
    if ids:
        check_forward(target, ids[0])
    policy = batch_policy(target, draft, block_size)
    decoder = BatchDecoder(target, draft, policy, prefill_step_size, head)
    eos = set(tokenizer.eos_token_ids)
    results = [GenerationResult(text="", tokens=[], prompt_tokens=p.size) for p in ids]
    waiting = list(range(n))

    def emit(i: int, tokens: list[int]) -> bool:
        """Append a row's tokens to its result; True once it has ended."""
        result = results[i]
        for token in tokens:
            if token in eos:
                result.finish_reason, result.error = ending("stop", samplers[i])
                return True
            result.tokens.append(token)
            if len(result.tokens) == limits[i]:
                result.finish_reason = "length"
                return True
        return False

    with wired_limit(target.model, [generation_stream]), mx.stream(generation_stream), drained(generation_stream):
        while waiting or decoder.rows:
            joining, waiting = waiting[: width - len(decoder.rows)], waiting[width - len(decoder.rows) :]
            if joining:  # prefilled together, as mlx-lm's batch generator does
                arrivals = [{"prompt": ids[i], "sampler": samplers[i], "max_tokens": limits[i], "tag": i}
                            for i in joining]
                for i, (row, first) in zip(joining, decoder.add_many(arrivals)):
                    if emit(i, [first]):
                        decoder.remove(row, caches=False)
            for cycle in decoder.cycle():
                i = cycle.row.tag
                if cycle.error:
                    decoder.remove(cycle.row, caches=False)
                    raise DFlashError(cycle.error)
                results[i].acceptance_lengths.append(cycle.accepted + 1)
                results[i].block_sizes.append(decoder.block_size)
                if emit(i, cycle.tokens):
                    decoder.remove(cycle.row, caches=False)
    for result in results:
        result.text = tokenizer.decode(result.tokens)
        result.peak_memory = mx.get_peak_memory() / 1e9
    return results
