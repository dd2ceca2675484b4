"""``dflash-mlx bench --concurrency N[,N...]``: several requests at once, our
``BatchDecoder`` beside mlx-lm's own batched decoding of the same target.

At each width N the prompts run in waves of N requests that arrive together:
the set in order, N at a time, the last wave wrapping round to the start of
the set so that every wave has N. Each wave runs on the same loaded target
twice, back to back: mlx-lm's ``BatchGenerator`` (N slots, its prompts
prefilled together, greedy) and our ``BatchDecoder`` with N rows (the
wave's requests prefilled together, ``add_many``, then cycles over all rows), the order
alternating between consecutive waves, after one untimed short wave of each
side at each width. Both are timed from outside, on one clock started when
the wave's requests arrive: a request's first token (time to first token)
and its last (its latency); the wave's aggregate throughput is every token
it generated over the time to its last one (prefill included on both sides).

At temperature 0 every reply is compared token by token with mlx-lm's reply
to the same request in the same repeat, and with our own ``generate`` of the
request alone (decoded once, untimed); a first divergence where the target's
two logits lie within ``NEAR_TIE`` of each other is a float near-tie (a
batched matmul may sum in another order), counted apart from a real one.
"""

import time
from typing import Callable, Optional

from .. import validate
from ..errors import DFlashError
from .concurrency_report import DFLASH, MLX_LM, make_report, render, summarize, validate_report
from .report import machine_info
from .runs import fresh
from .summary import compare_tokens

NEAR_TIE = 1e-3  # logit gap below which float reassociation may flip an argmax


def parse_width(text: str) -> int:
    """One ``--concurrency`` value: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise DFlashError(f"Invalid value for '--concurrency': '{text}' is not an integer") from None
    return validate.integer(value, "--concurrency", low=1)


def waves(n_prompts: int, width: int) -> list[list[int]]:
    """Prompt indices of each wave: N at a time in order, the last wave
    wrapping round to the start so that every wave has ``width``."""
    count = -(-n_prompts // width)
    return [[(w * width + i) % n_prompts for i in range(width)] for w in range(count)]


# ---------------------------------------------------------------- one wave, each side

def run_mlx_lm(model, ids: list[list[int]], max_tokens: int, eos: list[int],
               clock: Callable[[], float] = time.perf_counter) -> dict:
    """mlx-lm's ``BatchGenerator`` over the wave: every request inserted at
    once, N slots, greedy; per request its tokens (without the EOS), finish
    reason, first and last token times."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    n = len(ids)
    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[t] for t in eos],
                         completion_batch_size=n, prefill_batch_size=n)
    fresh()
    tic = clock()
    uids = gen.insert([list(p) for p in ids], [max_tokens] * n)
    row = {uid: i for i, uid in enumerate(uids)}
    requests = [{"tokens": [], "finish_reason": None, "first_s": None, "done_s": None} for _ in ids]
    left = n
    while left:
        responses = gen.next_generated()
        now = clock() - tic
        if not responses:
            raise DFlashError("mlx-lm's BatchGenerator stopped before every request ended")
        for r in responses:
            req = requests[row[r.uid]]
            if req["first_s"] is None:
                req["first_s"] = now
            if r.finish_reason != "stop":
                req["tokens"].append(r.token)
            if r.finish_reason is not None:
                req["finish_reason"], req["done_s"] = r.finish_reason, now
                left -= 1
    gen.close()
    return {"requests": requests, "wall_s": max(q["done_s"] for q in requests),
            "peak_memory_gb": mx.get_peak_memory() / 1e9}


def run_dflash(target, draft, policy, tokenizer, ids: list[list[int]], max_tokens: int, eos: list[int],
               clock: Callable[[], float] = time.perf_counter) -> dict:
    """Our ``BatchDecoder`` over the wave, driven as ``batch_generate`` drives
    it: the wave's requests added together (one batched prefill), then cycles over
    the rows, each leaving once it ends; per request as ``run_mlx_lm``, plus
    its accepted drafts per cycle, and the batch's block per cycle."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream, wired_limit

    from ..generate import drained, request_sampler
    from ..loop import BatchDecoder

    decoder = BatchDecoder(target, draft, policy)
    samplers = [request_sampler(tokenizer, target.vocab_size) for _ in ids]
    prompts = [mx.array(p, dtype=mx.int32) for p in ids]
    stop = set(eos)
    requests = [{"tokens": [], "finish_reason": None, "first_s": None, "done_s": None, "accepted": []}
                for _ in ids]
    blocks, widths = [], []

    def emit(i: int, tokens: list[int], now: float) -> bool:
        req = requests[i]
        for token in tokens:
            if token in stop:
                req["finish_reason"], req["done_s"] = "stop", now
                return True
            req["tokens"].append(token)
            if len(req["tokens"]) == max_tokens:
                req["finish_reason"], req["done_s"] = "length", now
                return True
        return False

    fresh()
    with wired_limit(target.model, [generation_stream]), mx.stream(generation_stream), drained(generation_stream):
        tic = clock()
        arrivals = [{"prompt": p, "sampler": samplers[i], "max_tokens": max_tokens, "tag": i}
                    for i, p in enumerate(prompts)]
        for i, (row, first) in enumerate(decoder.add_many(arrivals)):  # prefilled together, as mlx-lm's
            now = clock() - tic
            requests[i]["first_s"] = now
            if emit(i, [first], now):
                decoder.remove(row, caches=False)
        while decoder.rows:
            cycles = decoder.cycle()
            now = clock() - tic
            blocks.append(decoder.block_size)
            widths.append(len(cycles))
            for c in cycles:
                i = c.row.tag
                if c.error:
                    raise DFlashError(c.error)
                requests[i]["accepted"].append(c.accepted)
                if emit(i, c.tokens, now):
                    decoder.remove(c.row, caches=False)
    return {"requests": requests, "wall_s": max(q["done_s"] for q in requests),
            "peak_memory_gb": mx.get_peak_memory() / 1e9, "blocks": blocks, "rows_per_cycle": widths}


# ---------------------------------------------------------------- identity

def divergence(model, prompt: list[int], got: dict, want: dict, eos: list[int]) -> Optional[dict]:
    """None when ``got``'s tokens equal ``want``'s; else the first divergence
    (``compare_tokens``) with the target's logit gap there between the two
    tokens (a side that stopped counts its EOS) and whether it is a near-tie."""
    import mlx.core as mx

    cmp = compare_tokens(want["tokens"], got["tokens"])
    if cmp["identical"]:
        return None
    d = cmp["first_divergence"]
    i = d["index"]
    ended = lambda side: eos[0] if side["finish_reason"] == "stop" else None  # noqa: E731
    a = got["tokens"][i] if i < len(got["tokens"]) else ended(got)
    b = want["tokens"][i] if i < len(want["tokens"]) else ended(want)
    gap = None
    if a is not None and b is not None:
        logits = model(mx.array(prompt + want["tokens"][:i])[None])[0, -1]
        gap = abs((logits[a] - logits[b]).item())
    return {"index": i, "ours": a, "theirs": b, "logit_gap": gap, "near_tie": gap is not None and gap < NEAR_TIE}


# ---------------------------------------------------------------- the whole run

def run_concurrency(model, draft, tokenizer, prompts: list[dict], *, widths: list[int], max_tokens: int,
                    block_size, repeat: int = 1, chat_template: bool = True,
                    enable_thinking: Optional[bool] = None, warmup_tokens: int = 16,
                    on_step: Optional[Callable[[str], None]] = None) -> dict:
    """Every width's waves, each on both sides, ``repeat`` times (repeats the
    outer loop, then widths, then waves; consecutive waves alternate which side
    goes first), then every request decoded alone by our ``generate``; returns
    the prompts, the runs, the solo replies, the summary per width and our
    warm-up waves' blocks (under auto, a wave at the draft's trained block
    besides the auto one). ``block_size``: ``"auto"``, an integer, or None (the draft's trained size)."""
    from ..chat import encode, template_ids
    from ..generate import generate
    from ..loop import batch_policy
    from ..targets import Target

    if not prompts:
        raise DFlashError("no prompts to run")
    validate.options({"max_tokens": max_tokens})
    validate.integer(repeat, "repeat", low=1)
    for w in widths:
        validate.integer(w, "concurrency", low=1)
    target = Target(model)
    encoded = [p["ids"] if "ids" in p
               else template_ids(tokenizer, p["prompt"], enable_thinking=enable_thinking) if chat_template
               else encode(tokenizer, p["prompt"]) for p in prompts]
    eos = sorted(tokenizer.eos_token_ids)
    batch_policy(target, draft, block_size)  # auto: its curve and batch factors measured (or read) off the clock

    def call(side: str, wave: list[int], tokens: int, blocks=block_size) -> dict:
        ids = [encoded[i] for i in wave]
        if side == MLX_LM:
            return run_mlx_lm(model, ids, tokens, eos)
        return run_dflash(target, draft, batch_policy(target, draft, blocks), tokenizer, ids, tokens, eos)

    warmup = []  # our warm-up waves' blocks, by width
    if warmup_tokens > 0:  # untimed: weights paged in, buffers of each width allocated
        tokens = min(warmup_tokens, max_tokens)
        for w in widths:
            wave = waves(len(encoded), w)[0]
            if on_step:
                on_step(f"warm-up x{w} {MLX_LM}")
            call(MLX_LM, wave, tokens)
            if on_step:
                on_step(f"warm-up x{w} {DFLASH}")
            ours = call(DFLASH, wave, tokens)
            if block_size == "auto":  # a short auto wave runs plain steps: draft too (None: the trained
                # block), so that the batch's drafting kernels are compiled here and not in a timed wave
                ours = call(DFLASH, wave, tokens, blocks=None)
            warmup.append({"width": w, "blocks": ours["blocks"]})
    runs, unit = [], 0
    for r in range(repeat):
        for w in widths:
            for k, wave in enumerate(waves(len(encoded), w)):
                order = (MLX_LM, DFLASH) if unit % 2 == 0 else (DFLASH, MLX_LM)
                unit += 1
                for side in order:
                    if on_step:
                        on_step(f"x{w} wave {k} r{r} {side}")
                    rec = call(side, wave, max_tokens)
                    for req, i in zip(rec["requests"], wave):
                        req["prompt_id"] = prompts[i]["id"]
                        req["generated"] = len(req["tokens"])
                    generated = sum(q["generated"] for q in rec["requests"])
                    runs.append({"step": len(runs), "side": side, "width": w, "repeat": r, "wave": k,
                                 "prompts": list(wave), "generated": generated,
                                 "tps": generated / rec["wall_s"] if rec["wall_s"] > 0 else None, **rec})
    if on_step:
        on_step("alone: our generate, untimed")
    solo = []
    for ids in encoded:
        res = generate(model, draft, tokenizer, ids, max_tokens=max_tokens,
                       block_size=draft.config.block_size if block_size is None else block_size)
        solo.append({"tokens": res.tokens, "finish_reason": res.finish_reason})
    for run in runs:
        for req, i in zip(run["requests"], run["prompts"]):
            if run["side"] == DFLASH:
                req["vs_solo"] = divergence(model, encoded[i], req, solo[i], eos)
    by = {(r["width"], r["repeat"], r["wave"], r["side"]): r for r in runs}
    for run in runs:
        if run["side"] == DFLASH:
            theirs = by[(run["width"], run["repeat"], run["wave"], MLX_LM)]
            for req, other, i in zip(run["requests"], theirs["requests"], run["prompts"]):
                req["vs_mlx_lm"] = divergence(model, encoded[i], req, other, eos)
    return {"prompts": [{**{k: v for k, v in p.items() if k != "ids"}, "prompt_tokens": len(ids)}
                        for p, ids in zip(prompts, encoded)],
            "runs": runs, "solo": solo, "summary": summarize(runs, widths), "warmup": warmup}


def main_concurrency(*, model: Optional[str], draft: Optional[str], prompts: str, max_tokens: int,
                     widths: list[int], block_size, repeat: int, limit: Optional[int],
                     categories: Optional[list[str]], dtype: str, chat_template: bool,
                     enable_thinking: Optional[bool], warmup: bool, json_out: Optional[str],
                     draft_dtype: str = "auto", err=None, out=None) -> dict:
    """The measured concurrency benchmark, from checked options: the pair
    resolved and the block checked against the draft before the models load;
    the table, then the JSON report."""
    from ..chat import has_template, thinking_note
    from ..draft import DraftConfig
    from ..precision import dtype_name
    from ..registry import read_config, resolve_pair
    from .calibrate import load_pair
    from .prompts import select_prompts
    from .render import console, stepping
    from .report import write_json

    err = err or console(stderr=True)
    out = out or console()
    chosen = select_prompts(prompts, categories, limit)
    pair = resolve_pair(model, draft)
    trained = DraftConfig.from_dict(read_config(pair.draft, "draft")).block_size
    warn = lambda message: err.print(f"warning: {message}", markup=False, highlight=False)  # noqa: E731
    block = validate.block_size(block_size, trained, "--block-size", warn)
    thinking = pair.enable_thinking if enable_thinking is None else enable_thinking
    target, tokenizer, dft, dtype = load_pair(pair, dtype, draft_dtype)
    if chat_template and has_template(tokenizer):
        err.print(thinking_note(thinking), markup=False, highlight=False)
    steps = sum(2 * len(waves(len(chosen), w)) for w in widths) * repeat + 2 * len(widths) * int(warmup) + 1
    with stepping(err, "bench --concurrency", steps, width=32) as on_step:
        result = run_concurrency(target, dft, tokenizer, chosen, widths=widths, max_tokens=max_tokens,
                                 block_size=block, repeat=repeat, chat_template=chat_template,
                                 enable_thinking=thinking, warmup_tokens=16 if warmup else 0, on_step=on_step)
    config = {"model": pair.target, "draft": pair.draft, "concurrency": widths, "max_tokens": max_tokens,
              "block_size": block, "repeat": repeat, "temperature": 0.0,
              "dtype": "checkpoint" if dtype == "keep" else dtype, "draft_dtype": dtype_name(dft),
              "chat_template": chat_template, "enable_thinking": thinking, "prompts": prompts,
              "categories": categories, "limit": limit, "warmup": warmup, "draft_trained_block_size": trained}
    report = make_report(result, config, machine_info())
    validate_report(report)
    render(report, out)
    if json_out:
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    return report
