"""Timed runs: mlx-lm's baseline and DFlash on the same loaded target, each
timed from outside its generator, and the whole schedule of them."""

import time
from typing import Callable, Iterable, Optional

from .. import validate
from ..chat import encode, template_ids
from ..errors import DFlashError
from .schedule import BASELINE, DFLASH, Arm, Step, schedule
from .summary import make_pairs, summarize


def _timed(responses: Iterable, clock: Callable[[], float] = time.perf_counter) -> tuple[list, float, float]:
    """Drain a generator; (responses, seconds to the first one, seconds to the
    last one). What a generator does after its last response is off the clock,
    as the step both sides queue ahead and never wait for is (``fresh``):
    DFlash's generator waits for its stream on leaving, mlx-lm's does not."""
    out, first, last = [], None, None
    tic = clock()
    for r in responses:
        last = clock() - tic
        if first is None:
            first = last
        out.append(r)
    if last is None:  # no response at all
        first = last = clock() - tic
    return out, first, last


def _record(prompt_tokens: int, tokens: list[int], finish: Optional[str], first_s: float,
            total_s: float, last) -> dict:
    import mlx.core as mx

    decode_s = total_s - first_s
    generated = len(tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "generated": generated,
        "finish_reason": finish,
        "prefill_s": first_s,
        "decode_s": decode_s,
        "wall_s": total_s,
        "prefill_tps": prompt_tokens / first_s if first_s > 0 else None,
        # tokens after the first over the time after it: the same clock for both sides
        "decode_tps": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else None,
        "reported_prompt_tps": getattr(last, "prompt_tps", None),
        "reported_generation_tps": getattr(last, "generation_tps", None),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        # a degenerate model repeats a few tokens: near 0 for a loop of one token
        "distinct_token_ratio": len(set(tokens)) / generated if generated else None,
    }


def fresh() -> None:
    """Before a run: let work the last run queued but never waited for (both
    generators queue their next step ahead) finish off the clock, free the
    allocator cache and reset the peak memory counter."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()


def run_baseline(model, tokenizer, ids: list[int], max_tokens: int, sampling: dict,
                 kv: Optional[dict] = None) -> dict:
    """mlx-lm's ``stream_generate`` on the target alone (``kv``: its kv_bits,
    kv_group_size and quantized_kv_start)."""
    import mlx.core as mx
    from mlx_lm import stream_generate as mlx_lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(sampling["temperature"], sampling["top_p"], sampling["min_p"],
                           top_k=sampling["top_k"])
    if sampling.get("seed") is not None:
        mx.random.seed(sampling["seed"])
    fresh()
    responses, first, total = _timed(
        mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler, **(kv or {})))
    # the last response carries the EOS token itself when generation stopped on it
    tokens = [r.token for r in responses if r.finish_reason != "stop"]
    last = responses[-1] if responses else None
    return _record(len(ids), tokens, last.finish_reason if last else None, first, total, last)


def run_dflash(model, draft, tokenizer, ids: list[int], max_tokens: int, block_size: int,
               sampling: dict, tree_budget: Optional[int] = None, draft_vocab: Optional[int] = None,
               kv: Optional[dict] = None, stream: Optional[Callable] = None, cost_curve=None,
               confidence_schedule: Optional[bool] = None) -> dict:
    """DFlash ``stream_generate`` (a DDTree of ``tree_budget`` nodes per cycle
    if given, else the chain; drafting over ``draft_vocab`` ids if given); adds
    the per-cycle accepted draft counts. ``stream`` replaces ``stream_generate``
    (a rank of a distributed launch: ``distributed.Launch.stream_generate``).
    ``cost_curve``: ``auto``'s, never measured again (None: the pair's
    cached one, measured again once cycles drift from it). ``confidence_schedule``:
    ``stream_generate``'s (None: its default)."""
    from ..generate import stream_generate

    fresh()
    responses, first, total = _timed((stream or stream_generate)(
        model, draft, tokenizer, ids, block_size=block_size, max_tokens=max_tokens,
        temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"],
        min_p=sampling["min_p"], seed=sampling.get("seed"), tree_budget=tree_budget,
        draft_vocab=draft_vocab, cost_curve=cost_curve, **(kv or {}),
        **({} if confidence_schedule is None else {"confidence_schedule": confidence_schedule})))
    tokens = [t for r in responses for t in r.tokens]
    last = responses[-1] if responses else None
    rec = _record(len(ids), tokens, last.finish_reason if last else None, first, total, last)
    accepted = [r.accepted for r in responses[1:]]  # the first response is the prefill token
    rec.update(cycles=len(accepted), accepted=accepted, blocks=[r.block_size for r in responses[1:]])
    return rec


def sharded_runners(launch) -> dict:
    """``run_bench``'s runners on a rank of ``launch`` (``distributed.Launch``),
    whose target is a sharded ``Target``: mlx-lm decodes its model, DFlash
    runs the group's loop."""
    return {BASELINE: lambda target, *args, **kwargs: run_baseline(target.model, *args, **kwargs),
            DFLASH: lambda *args, **kwargs: run_dflash(*args, stream=launch.stream_generate, **kwargs)}


def run_bench(
    model, draft, tokenizer, prompts: list[dict], *, arms: list[Arm], max_tokens: int,
    repeat: int = 1, sampling: Optional[dict] = None, chat_template: bool = True,
    enable_thinking: Optional[bool] = None, warmup_tokens: int = 16,
    on_step: Optional[Callable[[str], None]] = None, runners: Optional[dict] = None,
    draft_vocab: Optional[int] = None, kv: Optional[dict] = None, cost_curve=None,
) -> dict:
    """Run the schedule over the DFlash ``arms``; returns prompts, runs, pairs
    and the summary.

    Prompts go through the chat template (``enable_thinking`` as in
    ``dflash_mlx.chat.apply_template``) unless ``chat_template`` is False.
    ``on_step(description)`` is called before every run (warm-up included) for a
    progress display. ``runners`` replaces ``{"baseline": run_baseline, "dflash":
    run_dflash}`` (tests give the baseline another target, for instance).
    ``draft_vocab`` N: every DFlash arm drafts over the N top-ranked ids.
    ``kv``: both sides quantize the KV cache with these mlx-lm arguments.
    ``cost_curve``: every ``auto`` run prices its blocks on it (a
    ``Watched`` one watched for drift inside the run), never measured again
    (without it each run reads the pair's cached curve, and a drift inside
    one would have the next measure the curve again inside its timed
    prefill, on whatever else the machine was doing then). A prompt with
    ``ids`` is fed as those ids, without a chat template.
    """
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 0, **(sampling or {})}
    runners = {BASELINE: run_baseline, DFLASH: run_dflash, **(runners or {})}
    if not prompts:
        raise DFlashError("no prompts to run")
    if not arms:
        raise DFlashError("no arms to run")
    validate.options({"max_tokens": max_tokens})
    validate.integer(repeat, "repeat", low=1)
    for arm in arms:
        if arm.block_size != validate.AUTO:
            validate.integer(arm.block_size, "block size", low=2)
        if arm.tree_budget is not None:
            validate.integer(arm.tree_budget, "tree budget", low=1)
    encoded = [p["ids"] if "ids" in p
               else template_ids(tokenizer, p["prompt"], enable_thinking=enable_thinking) if chat_template
               else encode(tokenizer, p["prompt"]) for p in prompts]
    quantized = {"kv": kv} if kv else {}
    curve = {"cost_curve": cost_curve} if cost_curve is not None else {}

    def call(step: Step, tokens: int) -> dict:
        ids = encoded[step.prompt]
        if step.arm == BASELINE:
            return runners[BASELINE](model, tokenizer, ids, tokens, sampling, **quantized)
        schedule = {} if step.confidence_schedule is None else {"confidence_schedule": step.confidence_schedule}
        return runners[DFLASH](model, draft, tokenizer, ids, tokens, step.block_size, sampling,
                               tree_budget=step.tree_budget, draft_vocab=draft_vocab, **quantized, **curve, **schedule)

    if warmup_tokens > 0:  # untimed: weights paged in, kernels and buffers allocated
        for step in schedule(1, 1, arms):
            if on_step:
                on_step(f"warm-up {step.label}")
            call(step, min(warmup_tokens, max_tokens))
    runs = []
    for i, step in enumerate(schedule(len(prompts), repeat, arms)):
        p = prompts[step.prompt]
        if on_step:
            on_step(f"{p['id']} r{step.repeat} {step.label}")
        rec = call(step, max_tokens)
        runs.append({"step": i, "prompt_id": p["id"], "category": p["category"],
                     "repeat": step.repeat, "arm": step.arm, "block_size": step.block_size,
                     "tree_budget": step.tree_budget, "confidence_schedule": step.confidence_schedule, **rec})
    pairs = make_pairs(runs, compare=sampling["temperature"] == 0)
    return {
        "prompts": [{**{k: v for k, v in p.items() if k != "ids"}, "prompt_tokens": len(ids)}
                    for p, ids in zip(prompts, encoded)],
        "runs": runs,
        "pairs": pairs,
        "summary": summarize(runs, pairs, arms),
    }

