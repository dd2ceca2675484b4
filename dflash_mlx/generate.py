"""Public generation API: ``stream_generate`` and ``generate``.

A superset of z-lab's ``dflash.model_mlx.stream_generate``: same call shape,
with per-cycle acceptance and timing in every response.
"""

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import structured, validate
from .chat import encode
from .draft import DFlashDraft
from .draft import subset_head
from .errors import DFlashError
from .kv_quantization import DEFAULT_QUANTIZED_KV_START, KVQuantization
from .loop import cost_curve as costs
from .loop import (AdaptiveBlock, BlockSampler, ContextCache, DriftWatch, FixedBlock, SamplingParams,
                   SpeculativeDecoder, Watched, proposer_for, times_for)
from .targets import check_forward
from .targets import Target
from .tree import TreeDecoder
from .vision import with_images

CLEAR_CACHE_EVERY = 256  # generated tokens between frees of MLX's allocator cache, as mlx-lm's
# generate_step frees it (freeing more often costs the next step its buffers: ~4 ms at 1k context here)


@dataclass
class GenerationResponse:
    """One streamed step: the tokens committed by one cycle (or by prefill)."""

    text: str  # new text segment
    tokens: list[int]  # ids emitted this step
    accepted: int  # draft tokens accepted this cycle (0 for the prefill token)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # emitted so far
    generation_tps: float
    peak_memory: float  # GB, from mx.get_peak_memory
    finish_reason: Optional[str] = None  # "stop" | "length" | "error" (see ``error``) | None
    block_size: int = 0  # block verified this cycle (0 for the prefill token, 1: a plain target step)
    drafted: int = 0  # the first ``drafted`` of ``tokens`` are accepted drafts; the rest are the target's own
    logprobs: Optional[mx.array] = None  # [len(tokens), V] the target's log-probabilities there (logprobs=True)
    error: Optional[str] = None  # why a reply under ``response_format`` stopped short of its grammar


@dataclass
class GenerationResult:
    """The whole output of ``generate``."""

    text: str
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # a+1 per cycle
    block_sizes: list[int] = field(default_factory=list)  # the block of each cycle
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # with finish_reason "error": why the reply stopped short of its grammar
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory: float = 0.0

    @property
    def mean_acceptance(self) -> float:
        """tau: mean tokens committed per verify cycle."""
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0


def check_pair(target: Target, draft: DFlashDraft) -> None:
    """Raise a one-line DFlashError if the draft was not made for this target."""
    cfg = draft.config
    if cfg.hidden_size != target.hidden_size:
        raise DFlashError(
            f"draft hidden_size {cfg.hidden_size} does not match the target's "
            f"{target.hidden_size}; use the draft made for this target"
        )
    if cfg.vocab_size != target.vocab_size:
        raise DFlashError(
            f"draft vocab_size {cfg.vocab_size} does not match the target's "
            f"{target.vocab_size}; use the draft made for this target"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_layers:
        raise DFlashError(
            f"draft num_target_layers {cfg.num_target_layers} does not match the "
            f"target's {target.num_layers} layers; use the draft made for this target"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DFlashError(
            f"draft target_layer_ids {bad} are out of range for a "
            f"{target.num_layers}-layer target"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DFlashError(
            f"draft mask_token_id {cfg.mask_token_id} is outside the target vocabulary"
        )


def encode_prompt(tokenizer: TokenizerWrapper, prompt, vocab_size: int) -> mx.array:
    """A prompt (text, encoded as is, or ids) as checked ids."""
    if isinstance(prompt, str):
        prompt = encode(tokenizer, validate.text(prompt))
    return mx.array(validate.token_ids(prompt, vocab_size))


SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "repetition_context_size",
            "presence_penalty", "frequency_penalty", "logit_bias",
            "logits_processors")  # one request's sampling arguments
SAMPLER_REFUSED = ("sampler is not accepted: speculative sampling needs the target's distribution, not a sampled "
                   "token; pass the settings it was made from instead (temperature, top_p, top_k, min_p)")


def refuse_unknown(what: str, given, accepted) -> None:
    """A one-line DFlashError naming the arguments of ``given`` that ``what``
    does not take and the ``accepted`` ones; an mlx-lm ``sampler`` is told
    what to pass instead."""
    unknown = [k for k in given if k not in accepted]
    if "sampler" in unknown:
        raise DFlashError(SAMPLER_REFUSED)
    if unknown:
        raise DFlashError(f"unknown arguments to {what}: {', '.join(unknown)}; "
                          f"the accepted ones are {', '.join(dict.fromkeys(accepted))}")


def keywords(*passed_on: str) -> Callable:
    """Decorator: a keyword argument that is neither the function's own nor
    one of ``passed_on`` (what its ``**`` takes) is a one-line DFlashError
    (``refuse_unknown``), not a TypeError."""

    def decorate(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        accepted = [n for n, p in params.items() if p.kind is not p.VAR_KEYWORD] + list(passed_on)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            refuse_unknown(f"{fn.__name__}()", kwargs, accepted)
            return fn(*args, **kwargs)

        return checked

    return decorate


def request_sampler(tokenizer, vocab_size: int, response_format: Optional[dict] = None, **sampling) -> BlockSampler:
    """One request's sampler: its ``SAMPLING`` arguments, checked (one-line
    DFlashError), and its ``response_format``'s grammar."""
    refuse_unknown("a request's sampling", sampling, SAMPLING)
    validate.logit_bias(sampling.get("logit_bias"), vocab_size)
    constraint = structured.constraint_for(response_format, tokenizer, vocab_size)
    return BlockSampler(SamplingParams(**sampling), constraint)


@contextlib.contextmanager
def drained(stream) -> Iterator[None]:
    """On leaving, however generation ends, wait for the work still queued on
    ``stream`` (the next block's draft): a process that then exits must not
    have a BLAS call in flight, or a multithreaded OpenBLAS never lets it end.
    (mlx-lm's ``wired_limit`` synchronizes on Metal only.)"""
    try:
        yield
    finally:
        mx.synchronize(stream)


@keywords()
def stream_generate(
    model: Union[nn.Module, Target],
    draft: DFlashDraft,
    tokenizer,
    prompt: Union[str, list[int], mx.array],
    block_size: Union[int, str, None] = "auto",
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    prefill_step_size: int = 2048,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: int = 20,
    presence_penalty: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    logit_bias: Optional[dict[int, float]] = None,
    logits_processors: Optional[list[Callable]] = None,
    context: Optional[ContextCache] = None,
    tree_budget: Optional[int] = None,
    cost_curve: Union[costs.CostCurve, Watched, None] = None,
    draft_vocab: Optional[int] = None,
    logprobs: bool = False,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    response_format: Optional[dict] = None,
    images: Optional[list] = None,
    confidence_schedule: bool = True,
) -> Generator[GenerationResponse, None, None]:
    """Generate with DFlash speculative decoding, one response per verify cycle.

    The output is distributed exactly as the target's own decoding with mlx-lm's
    sampler and logits processors of the same settings: at temperature 0 it is
    the target's greedy tokens; above 0, drafts pass through lossless rejection
    sampling. ``logits_processors`` are mlx-lm's (``(tokens, logits) -> logits``),
    applied after those of ``logit_bias`` and the penalties to every verified
    position with the whole history before it, prompt included, as mlx-lm's
    ``generate_step`` applies them; rejected drafts' positions are processed
    too, so each must depend on its arguments alone. An mlx-lm ``sampler`` is
    refused: rejection sampling needs the distribution, so pass ``temperature``,
    ``top_p``, ``top_k`` and ``min_p``; so is any unknown keyword (a one-line
    DFlashError). ``prompt`` is a string (encoded as is, no chat template; see
    ``dflash_mlx.chat``) or integer ids in a list, NumPy array or ``mx.array``.
    Generation stops at EOS (not emitted) or after exactly ``max_tokens``
    tokens. ``seed`` makes sampling reproducible. Arguments are checked by
    ``dflash_mlx.validate``; a ``block_size`` above the draft's trained size
    warns, above twice it is an error. ``block_size="auto"`` (the default)
    picks each cycle's block, 1 to the trained size, for the most expected
    tokens per second (``loop.AdaptiveBlock``) from ``cost_curve``
    (default: the pair's, measured on this machine at first use and cached,
    ``loop/cost_curve.py``; a ``CostCurve`` is taken as it is, a ``loop.Watched`` one
    watched for drift as the default is); None is the trained size. The block never changes
    the output's distribution; each response reports the block it used. Under "auto", a
    DSpark draft with a confidence head verifies only the drafts its confidences and the
    curve say pay (``loop.block_policy.ConfidenceSchedule``, docs/dspark.md);
    ``confidence_schedule=False`` turns that off (auto's block, every draft of it
    verified), and is an error where no schedule would run (a fixed block, a
    tree, a draft without a confidence head).
    ``context`` continues from caches that already hold a proper prefix of the
    prompt (only the rest is prefilled) and is left holding every fed token.
    ``tree_budget`` B >= 1 verifies a DDTree of up to B drafted nodes per cycle
    instead of one chain (``tree/decoder.py``), at any temperature; 0 or None is the chain.
    ``draft_vocab`` N drafts over the N most frequent ids of the ranking stored
    beside the draft (``draft/vocab.py``; lossless, verification keeps the full
    vocabulary); None is the full vocabulary.
    ``response_format`` constrains the output to a grammar, in OpenAI's shape
    (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
    {"schema": ...}}``) or ``{"type": "regex", "regex": ...}`` /
    ``{"type": "grammar", "grammar": <Lark>}`` (``structured.py``): exactly
    what the target alone decodes under the grammar's mask.
    ``logprobs=True`` gives each response the target's log-probabilities over
    the vocabulary at each emitted token's position (``logits - logsumexp``
    after the logits processors, before temperature and top-p/k: what mlx-lm's
    ``generate_step`` yields), lazy, read from the verify pass at no extra pass.
    ``kv_bits`` (2-6 or 8) quantizes the target's full-attention KV caches in
    groups of ``kv_group_size`` once they hold ``quantized_kv_start`` tokens,
    as mlx-lm's ``generate_step`` does with the same three arguments, whose
    output this then equals (``kv_quantization.py``); None keeps them full precision.
    ``images`` (paths, bytes, PIL images, data or http(s) URLs) go where the
    prompt's image placeholders stand, one each, as the chat template writes
    image parts; the prefill runs over their features (``vision``, docs/vision.md).
    Or ``model`` is the ``VisionTarget`` of ``vision.with_images`` and ``prompt``
    its expanded ids, without ``images``: then ``context`` may hold a prefix of them.
    """
    validate.options({k: v for k, v in locals().items() if k in validate.RULES})
    validate.loaded(model, draft, tokenizer, cost_curve, (costs.CostCurve, Watched))
    target = model if isinstance(model, Target) else Target(model)
    check_pair(target, draft)
    trained = draft.config.block_size
    block_size = trained if block_size is None else validate.block_size(block_size, trained)
    tree_budget = validate.tree_budget(tree_budget, getattr(target.args, "max_position_embeddings", None))
    confidence_schedule = validate.confidence_schedule(confidence_schedule, schedules(draft), block_size,
                                                       tree_budget, confidence_schedule is False)
    kv = None
    if kv_bits is not None:
        kv = KVQuantization(kv_bits, kv_group_size, quantized_kv_start)
        kv.check(target)
    head = None
    if draft_vocab is not None:
        head = subset_head(target, draft.vocab_ranking, draft_vocab)  # an integer >= 1: checked above
    sampler = request_sampler(
        tokenizer, target.vocab_size, response_format, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, seed=seed, repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias,
        logits_processors=logits_processors,
    )
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt_ids = encode_prompt(tokenizer, prompt, target.vocab_size)
    check_forward(target, prompt_ids)
    plain = target
    if images:
        if tree_budget or (context is not None and context.tokens):
            raise DFlashError("a prompt with images takes neither tree_budget nor a context cache holding tokens")
        target, prompt_ids, _ = with_images(target, prompt_ids, images)
    validate.prompt_length(prompt_ids.size, getattr(target.args, "max_position_embeddings", None))
    kept = context is not None  # the caller keeps the caches: the draft's must end holding every fed token
    if context is None:
        context = ContextCache(target.make_cache(), draft.make_cache())
    n = len(context.tokens)
    if n >= prompt_ids.size or prompt_ids[:n].tolist() != context.tokens:
        raise DFlashError("the context cache does not hold a proper prefix of the prompt")
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    proposer = proposer_for(draft, target, context.draft, head)
    if tree_budget:  # the tree drafts b-1 positions deep
        depth_block = block_size if isinstance(block_size, int) else trained
        decoder = TreeDecoder(target, proposer, draft.config.target_layer_ids, depth_block, tree_budget,
                              prefill_step_size, sampler, context.target, context.tokens, kv)
    else:
        if block_size == validate.AUTO:
            policy = auto_policy(plain, draft, cost_curve, sampled=not sampler.greedy)
            if confidence_schedule and schedules(draft):  # a DSpark draft verifies what pays, by c_k
                proposer.schedule_by(policy.costs)
        else:
            policy = FixedBlock(block_size)
        decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, policy,
                                     prefill_step_size, sampler, context.target, context.tokens, kv)
        decoder.max_tokens = max_tokens  # no block drafted past them, nothing queued after the last
    decoder.keep_logprobs = logprobs
    with wired_limit(target.model, [generation_stream]), mx.stream(generation_stream), \
            drained(generation_stream), contextlib.closing(decoder) if kept else contextlib.nullcontext():
        tic = time.perf_counter()
        committed = [decoder.prefill(prompt_ids)]
        prompt_tps = prompt_ids.size / (time.perf_counter() - tic)
        tic = time.perf_counter()
        accepted = generated = used = 0
        while True:
            emitted, finish, error = [], None, None
            for token in committed:
                if token in eos:
                    finish = "stop"
                    break
                emitted.append(token)
                if generated + len(emitted) == max_tokens:
                    finish = "length"
                    break
            for token in emitted:
                detokenizer.add_token(token)
            if finish:
                detokenizer.finalize()
                finish, error = ending(finish, sampler)
            generated += len(emitted)
            yield GenerationResponse(
                text=detokenizer.last_segment,
                tokens=emitted,
                accepted=accepted,
                prompt_tokens=prompt_ids.size,
                prompt_tps=prompt_tps,
                generation_tokens=generated,
                generation_tps=generated / (time.perf_counter() - tic),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                block_size=used,
                drafted=min(accepted, len(emitted)),
                logprobs=None if decoder.logprobs is None else decoder.logprobs[: len(emitted)],
                error=error,
            )
            if finish:
                return
            used = decoder.block_size
            cycle = decoder.cycle()
            committed, accepted = cycle.tokens, cycle.accepted
            if (generated + len(committed)) // CLEAR_CACHE_EVERY > generated // CLEAR_CACHE_EVERY:
                mx.clear_cache()


def ending(finish: str, sampler: BlockSampler) -> tuple[str, Optional[str]]:
    """(finish reason, error) of a reply that ended with ``finish``: "error"
    and why where it ended at EOS short of its ``response_format``'s grammar
    (the grammar went no further), else ``finish`` and None."""
    constraint = sampler.constraint
    error = constraint.verdict() if finish == "stop" and constraint is not None else None
    return ("error", error) if error else (finish, None)


def schedules(draft: DFlashDraft) -> bool:
    """Whether ``block_size="auto"`` verifies the draft's blocks by a confidence
    schedule: a DSpark draft with a confidence head."""
    return getattr(draft, "confidence_head", None) is not None


def auto_policy(target: Target, draft: DFlashDraft,
                curve: Union[costs.CostCurve, Watched, None], sampled: bool = False) -> AdaptiveBlock:
    """``block_size="auto"``'s policy: on the given curve as it is; on a
    ``Watched`` one watched; or on the pair's measured one, watched so and
    measured again next time once the cycles drift from it. Watched, a greedy
    generation weighs the cycles at the costs this process observed on the
    curve (``loop/drift_watch.py``); a ``sampled`` one is never rescaled by
    timings (its seeded draws follow the blocks): its blocks follow the curve
    and the outcomes alone."""
    if curve is not None and not isinstance(curve, Watched):
        return AdaptiveBlock(curve, draft.config.block_size)
    forget = None
    if curve is None:
        curve = Watched(costs.cost_curve(target, draft))
        forget = lambda: costs.forget(target, draft)  # noqa: E731
    watch = DriftWatch(curve.curve, on_drift=forget, rescale=not sampled, times=times_for(curve.curve))
    return AdaptiveBlock(curve.curve, draft.config.block_size, watch=watch)


@keywords(*inspect.signature(stream_generate).parameters)
def generate(model, draft, tokenizer, prompt, **kwargs) -> GenerationResult:
    """Run ``stream_generate`` to the end; same arguments."""
    result = GenerationResult(text="", tokens=[])
    for i, r in enumerate(stream_generate(model, draft, tokenizer, prompt, **kwargs)):
        result.text += r.text
        result.tokens += r.tokens
        if i > 0:
            result.acceptance_lengths.append(r.accepted + 1)
            result.block_sizes.append(r.block_size)
        result.finish_reason, result.error = r.finish_reason, r.error
        result.prompt_tokens = r.prompt_tokens
        result.prompt_tps = r.prompt_tps
        result.generation_tps = r.generation_tps
        result.peak_memory = r.peak_memory
    return result
