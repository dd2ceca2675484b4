"""``dflash-mlx bench --synthetic``: how much of the ideal speedup the loop keeps.

A random llama target of about 200M parameters is built in memory (nothing is
downloaded or written) and decoded by the real ``SpeculativeDecoder`` with an
oracle proposer that knows the target's greedy continuation and is right for
all, half or none of each block. The ideal speedup of a cycle is

    tau * t_AR / (t_verify(b) + t_draft(b))

with t_AR mlx-lm's time per token, t_verify(b) one target pass over b tokens
and t_draft(b) the oracle's proposal; the loop's efficiency is the measured
speedup (DFlash tok/s over mlx-lm's) divided by it: what per-cycle overhead
(acceptance, rollback, bookkeeping, the host sync) leaves of the passes' work.
With ``--context`` the prompt has that many tokens (the target's positions
are raised to fit), so t_AR, t_verify and the loop all run at that context.
"""

import copy
import time
from dataclasses import asdict, dataclass
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ..loop import SpeculativeDecoder, prefill_chunks
from ..targets import Target
from .render import console

MODES = {"full": 1.0, "half": 0.5, "none": 0.0}  # share of each block's drafts that are right
CONFIG = dict(model_type="llama", hidden_size=1024, num_hidden_layers=12, intermediate_size=2816,
              num_attention_heads=16, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=32000,
              max_position_embeddings=4096, tie_word_embeddings=True)
HYBRID = dict(hidden_size=1024, num_hidden_layers=12, full_attention_interval=4, intermediate_size=2816,
              num_attention_heads=16, num_key_value_heads=4, head_dim=64, linear_num_key_heads=8,
              linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-6, vocab_size=32000, max_position_embeddings=4096,
              tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
PROMPT = 32  # prompt tokens
PREFILL_STEP = 2048  # prompt tokens per prefill pass, as the loop's and mlx-lm's default
REPEATS = 5  # timed passes per t_verify / t_draft
RUNS = 2  # timed runs per mlx-lm and DFlash figure
# Every figure is the best of its repeats (the fastest pass, the fastest run): background
# load only ever slows a run down, so the best is the closest to what the work itself costs.


@dataclass
class Row:
    context: int  # prompt tokens
    mode: str
    block_size: int
    tau: float
    ar_tps: float
    dflash_tps: float
    t_verify_ms: float
    t_draft_ms: float

    @property
    def measured(self) -> float:
        return self.dflash_tps / self.ar_tps

    @property
    def predicted(self) -> float:
        return self.tau * (1e3 / self.ar_tps) / (self.t_verify_ms + self.t_draft_ms)

    @property
    def efficiency(self) -> float:
        return self.measured / self.predicted


def synthetic_target(seed: int = 0, **overrides):
    """A random mlx-lm llama (about 200M parameters at the defaults), float32."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**{**CONFIG, **overrides}))
    mx.eval(model.parameters())
    return model


def hybrid_target(seed: int = 0, **overrides):
    """A random mlx-lm qwen3_5: 9 GatedDeltaNet and 3 attention layers, Qwen3.5's
    head sizes (Dk = Dv = 128), about 220M parameters at the defaults, float32."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(seed)
    text = {**HYBRID, **overrides, "model_type": "qwen3_5"}
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    mx.eval(model.parameters())
    return model


class Oracle:
    """Proposes the known continuation, wrong from draft position ``right + 1`` on."""

    def __init__(self, prompt_len: int, continuation: list[int], share: float, vocab_size: int, position: int = 0):
        self.position, self.prompt_len = position, prompt_len  # position: rows already observed
        self.continuation, self.share, self.vocab_size = continuation, share, vocab_size

    def observe(self, features, tokens) -> None:
        self.position += tokens.size

    def propose(self, y, block_size: int) -> mx.array:
        start = self.position - self.prompt_len + 1
        tokens = list(self.continuation[start : start + block_size - 1])
        tokens += [0] * (block_size - 1 - len(tokens))
        right = round(self.share * (block_size - 1))
        tokens = tokens[:right] + [(t + 1) % self.vocab_size for t in tokens[right:]]
        return (mx.arange(self.vocab_size)[None] == mx.array(tokens)[:, None]).astype(mx.float32)


def _prefix_cache(target: Target, prompt: mx.array) -> list:
    """The target's cache over all but the prompt's last token, fed in the
    loop's chunks: prefilled once per context, copied into every run (only
    decode is timed, and a long context's prefill is most of a run's time)."""
    cache = target.make_cache()
    for start, stop in prefill_chunks(0, prompt.size, PREFILL_STEP)[:-1]:  # the last: the prompt's last token
        target.forward(prompt[None, start:stop], cache, [0])
        mx.eval([c.state for c in cache])
    return cache


def _autoregressive(model, prompt: mx.array, n: int, prefix: Optional[list] = None) -> tuple[list[int], float]:
    """mlx-lm's greedy tokens and its decode speed (tokens after the first over
    the time after it); with ``prefix`` (a cache of all but the prompt's last
    token, ``_prefix_cache``) only the last token is fed, to a copy of it."""
    from mlx_lm.generate import generate_step

    if prefix is not None:
        prompt, prefix = prompt[-1:], copy.deepcopy(prefix)
    tokens, tic = [], None
    for token, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=prefix):
        tokens.append(token)
        if tic is None:
            tic = time.perf_counter()
    return tokens, (len(tokens) - 1) / (time.perf_counter() - tic)


def _fastest(run) -> float:
    run()
    times = []
    for _ in range(REPEATS):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    return min(times)


def _pass_times(target: Target, oracle: Oracle, prompt: mx.array, prefix: list, b: int) -> tuple[float, float]:
    """(t_verify(b), t_draft(b)) in seconds after the prompt."""
    cache = copy.deepcopy(prefix)
    block = mx.arange(b, dtype=mx.int32)

    def verify():
        out = target.forward(block[None], cache, [0], record=True)
        mx.eval(mx.argmax(target.logits(out.hidden), axis=-1))
        target.rollback(cache, out, 1)

    return _fastest(verify), _fastest(lambda: mx.eval(oracle.propose(prompt[-1:], b)))


def _dflash(target: Target, oracle_args: tuple, prompt: mx.array, prefix: list, b: int,
            max_tokens: int) -> tuple[float, float]:
    """(tau, decode tok/s) of the real loop with a fresh oracle, its cache
    starting from ``prefix`` as a server's prompt cache would."""
    oracle = Oracle(*oracle_args, position=prompt.size - 1)
    decoder = SpeculativeDecoder(target, oracle, [0], b, cache=copy.deepcopy(prefix), tokens=prompt[:-1].tolist())
    out = [decoder.prefill(prompt)]
    cycles, tic = 0, time.perf_counter()
    while len(out) < max_tokens:
        out += decoder.cycle().tokens
        cycles += 1
    return (len(out) - 1) / cycles, (len(out) - 1) / (time.perf_counter() - tic)


def run_synthetic(block_sizes: list[int], max_tokens: int, model=None, context: int = PROMPT) -> list[Row]:
    """One row per mode and block size, after a prompt of ``context`` tokens."""
    model = model or synthetic_target()
    target = Target(model)
    prompt = mx.arange(context, dtype=mx.int32) * 7 % target.vocab_size
    prefix = _prefix_cache(target, prompt)
    runs = [_autoregressive(model, prompt, max_tokens + max(block_sizes) + 1, prefix) for _ in range(RUNS)]
    continuation, ar_tps = runs[0][0], max(tps for _, tps in runs)
    rows = []
    for b in block_sizes:
        for mode, share in MODES.items():
            oracle_args = (context, continuation, share, target.vocab_size)
            t_verify, t_draft = _pass_times(target, Oracle(*oracle_args), prompt, prefix, b)
            tau, dflash_tps = max((_dflash(target, oracle_args, prompt, prefix, b, max_tokens) for _ in range(RUNS)),
                                  key=lambda run: run[1])
            rows.append(Row(context, mode, b, tau, ar_tps, dflash_tps, t_verify * 1e3, t_draft * 1e3))
    return rows


def main_synthetic(block_sizes: list[int], max_tokens: int, contexts: Optional[list[int]] = None,
                   out=None) -> list[dict]:
    """The table for each context (default: a ``PROMPT``-token prompt)."""
    from rich.table import Table

    out = out or console()
    contexts = contexts or [PROMPT]
    positions = max(CONFIG["max_position_embeddings"], max(contexts) + max_tokens + 2 * max(block_sizes))
    model = synthetic_target(max_position_embeddings=positions)
    rows = [r for c in contexts for r in run_synthetic(block_sizes, max_tokens, model, c)]
    params = sum(p.size for _, p in tree_flatten(model.parameters())) / 1e6
    t = Table(title=f"synthetic llama target ({params:.0f}M parameters, float32), {max_tokens} tokens, "
                    f"oracle drafts: loop efficiency = measured / ideal speedup")
    for col in ("context", "oracle", "block", "tau", "mlx-lm tok/s", "DFlash tok/s", "verify ms", "draft ms",
                "ideal speedup", "measured", "efficiency"):
        t.add_column(col, justify="left" if col == "oracle" else "right")
    for r in rows:
        t.add_row(str(r.context), r.mode, str(r.block_size), f"{r.tau:.2f}", f"{r.ar_tps:.1f}", f"{r.dflash_tps:.1f}",
                  f"{r.t_verify_ms:.2f}", f"{r.t_draft_ms:.2f}", f"{r.predicted:.2f}x",
                  f"{r.measured:.2f}x", f"{r.efficiency:.2f}")
    out.print(t)
    return [{**asdict(r), "predicted": r.predicted, "measured": r.measured, "efficiency": r.efficiency}
            for r in rows]
