"""Training data for DFlash drafts: a text/JSONL corpus, or the target's own
greedy continuations of prompts (self-distillation, the published recipe).

Both kinds are sampled by a pure function of a NumPy generator, so a training
step's batch depends only on (seed, step, micro-batch) and resuming is exact.
"""

import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..atomic import staged_file
from ..errors import DFlashError
from ..targets import Target
from .config import DraftTrainConfig
from .progress import log
from .records import Record, prompt_ids, read_records, record_ids


class Dataset:
    """Token sequences with, per sequence, the first position an anchor may take."""

    def sample(self, rng: np.random.Generator, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [B, T] int32, lo [B], hi [B]): anchors a satisfy lo <= a <= hi - 1,
        with every label position a + k (k < block) below hi + block - 1."""
        raise NotImplementedError


class StreamData(Dataset):
    """Random windows of a token stream (documents separated by EOS)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = np.asarray(tokens, dtype=np.int32)

    def __len__(self):
        return len(self.tokens)

    def sample(self, rng, batch, seq_len):
        if len(self.tokens) < seq_len:
            raise DFlashError(
                f"the corpus has {len(self.tokens)} tokens, fewer than --seq-len {seq_len}"
            )
        starts = rng.integers(0, len(self.tokens) - seq_len + 1, size=batch)
        x = np.stack([self.tokens[s : s + seq_len] for s in starts])
        return x, np.ones(batch, np.int64), np.full(batch, seq_len, np.int64)


class SequenceData(Dataset):
    """Whole sequences (prompt + completion); anchors only in the completion.

    Sequences longer than the training length keep their last ``seq_len``
    tokens; shorter ones are right-padded (padding is never attended to by a
    valid position, nor used as a label).
    """

    def __init__(self, sequences: list[np.ndarray], prompt_lens: Sequence[int], pad_id: int = 0):
        self.sequences = [np.asarray(s, dtype=np.int32) for s in sequences]
        self.prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
        self.pad_id = pad_id

    def __len__(self):
        return len(self.sequences)

    def sample(self, rng, batch, seq_len):
        return self.rows(self.sample_indices(rng, batch), seq_len)

    def sample_indices(self, rng, batch) -> np.ndarray:
        return rng.integers(0, len(self.sequences), size=batch)

    def rows(self, idx, seq_len):
        """(tokens [len(idx), seq_len], lo, hi) of the given sequences."""
        batch = len(idx)
        x = np.full((batch, seq_len), self.pad_id, np.int32)
        lo = np.empty(batch, np.int64)
        hi = np.empty(batch, np.int64)
        for row, i in enumerate(idx):
            s, p = self.sequences[i], int(self.prompt_lens[i])
            if len(s) > seq_len:
                p = max(p - (len(s) - seq_len), 1)
                s = s[-seq_len:]
            x[row, : len(s)] = s
            lo[row], hi[row] = max(p, 1), len(s)
        return x, lo, hi

    def save(self, path: Path) -> None:
        lengths = np.array([len(s) for s in self.sequences], np.int64)
        flat = np.concatenate(self.sequences) if self.sequences else np.zeros(0, np.int32)
        with staged_file(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, tokens=flat, lengths=lengths, prompt_lens=self.prompt_lens)

    @classmethod
    def load(cls, path: Path, pad_id: int = 0) -> "SequenceData":
        data = np.load(path)
        ends = np.cumsum(data["lengths"])
        seqs = np.split(data["tokens"], ends[:-1]) if len(ends) else []
        return cls(seqs, data["prompt_lens"], pad_id)


def corpus_stream(tokenizer, records: Iterable[Record], eos_id: int) -> np.ndarray:
    """All records tokenized into one stream, each followed by EOS."""
    ids = []
    for r in records:
        seq, _ = record_ids(tokenizer, r)
        ids.extend(seq)
        ids.append(eos_id)
    return np.array(ids, dtype=np.int32)


def stream_prompts(
    stream: np.ndarray, count: int, lengths: Sequence[int], rng: np.random.Generator, eos_id: int
) -> list[list[int]]:
    """``count`` prompts cut from a token stream at random places (no EOS inside)."""
    lengths = [n for n in lengths if n < len(stream)] or [max(len(stream) // 2, 1)]
    prompts, tries = [], 0
    while len(prompts) < count and tries < count * 50 and len(stream) > 1:
        tries += 1
        n = int(lengths[rng.integers(0, len(lengths))])
        s = int(rng.integers(0, len(stream) - n))
        window = stream[s : s + n]
        if eos_id in window:
            continue
        prompts.append(window.tolist())
    return prompts


# ----------------------------------------------------------------------------
# self-distillation


def greedy_continuations(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Iterable[int],
    batch_size: int = 32,
    progress: Optional[Callable[[int, int], None]] = None,
) -> list[list[int]]:
    """The target's greedy continuation of every prompt (up to and including EOS).

    Prompts of equal length run as one batch with mlx-lm's caches; the order
    of the result matches ``prompts``.
    """
    eos = np.array(sorted(set(eos_ids)) or [-1])
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if not len(p):
            raise DFlashError("an empty prompt cannot be continued")
        by_len.setdefault(len(p), []).append(i)
    out: list[Optional[list[int]]] = [None] * len(prompts)
    done = 0
    make_cache = getattr(model, "make_cache", None)
    for length in sorted(by_len):
        group = by_len[length]
        for start in range(0, len(group), batch_size):
            rows = group[start : start + batch_size]
            x = mx.array([list(prompts[i]) for i in rows], dtype=mx.int32)
            if make_cache is not None:
                cache = make_cache()
            else:
                from mlx_lm.models.cache import make_prompt_cache

                cache = make_prompt_cache(model)
            logits = model(x, cache=cache)[:, -1]
            toks = []
            for _ in range(max_new_tokens):
                y = mx.argmax(logits, axis=-1).astype(mx.int32)
                toks.append(y)
                logits = model(y[:, None], cache=cache)[:, -1]
                mx.async_eval(logits)
            gen = np.array(mx.stack(toks, axis=1)) if toks else np.zeros((len(rows), 0), np.int32)
            for r, i in enumerate(rows):
                seq = gen[r].tolist()
                hits = np.nonzero(np.isin(gen[r], eos))[0]
                if len(hits):
                    seq = seq[: hits[0] + 1]
                out[i] = seq
            done += len(rows)
            if progress is not None:
                progress(done, len(prompts))
    return out


# ----------------------------------------------------------------------------
# preparation


def _eos_ids(tokenizer) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return sorted(ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if eos is not None else []


def _held_out_tokens(n: int, cfg: DraftTrainConfig) -> int:
    """Tokens kept off the end of a corpus for eval prompts (about 2%)."""
    if cfg.eval_prompts <= 0:
        return 0
    return min(max(n // 50, 4 * max(cfg.prompt_lengths)), n // 5)


def _split_stream(tokenizer, records, cfg: DraftTrainConfig, rng, pad: int, eval_prompts):
    """(training stream, eval prompts): unless eval prompts are given, they are cut
    from a held-out tail of the corpus stream."""
    stream = corpus_stream(tokenizer, records, pad)
    n_eval = _held_out_tokens(len(stream), cfg) if not eval_prompts else 0
    if n_eval:
        held = stream[len(stream) - n_eval :]
        eval_prompts = stream_prompts(held, cfg.eval_prompts, cfg.prompt_lengths, rng, pad)
    return stream[: len(stream) - n_eval], eval_prompts


def prepare_data(
    target: Target, tokenizer, data_paths: Sequence[str], cfg: DraftTrainConfig,
    out_dir: Path, seed: int, eval_prompt_paths: Optional[Sequence[str]] = None,
    reuse_cache: bool = True,
) -> tuple[object, list[list[int]]]:
    """(training dataset, held-out eval prompts). Self-distilled data is cached in
    ``out_dir/distill.npz`` so a resumed run reuses it (``reuse_cache``)."""
    eos = _eos_ids(tokenizer)
    pad = eos[0] if eos else 0
    records = read_records(data_paths)
    rng = np.random.default_rng([seed, 7919])
    eval_prompts: list[list[int]] = []
    if eval_prompt_paths:
        eval_prompts = [
            prompt_ids(tokenizer, r) or tokenizer.encode(r.text)
            for r in read_records(eval_prompt_paths)
        ][: max(cfg.eval_prompts, 0)]
    prompt_records = [r for r in records if prompt_ids(tokenizer, r) is not None]

    if not cfg.self_distill:
        train_stream, eval_prompts = _split_stream(tokenizer, records, cfg, rng, pad, eval_prompts)
        return StreamData(train_stream), eval_prompts

    # self-distillation: prompts -> the target's greedy continuations
    if prompt_records:
        prompts = [prompt_ids(tokenizer, r) for r in prompt_records]
        order = rng.permutation(len(prompts))
        prompts = [prompts[i] for i in order]
        if not eval_prompts and cfg.eval_prompts > 0:
            k = min(cfg.eval_prompts, max(len(prompts) // 10, 1))
            eval_prompts, prompts = prompts[:k], prompts[k:]
        prompts = prompts[: cfg.num_prompts]
    else:
        train_stream, eval_prompts = _split_stream(tokenizer, records, cfg, rng, pad, eval_prompts)
        prompts = stream_prompts(train_stream, cfg.num_prompts, cfg.prompt_lengths, rng, pad)
    if not prompts:
        raise DFlashError("no training prompts left for self-distillation")
    cache = Path(out_dir) / "distill.npz"
    if reuse_cache and cache.is_file():
        data = SequenceData.load(cache, pad)
        if len(data) == len(prompts):
            log(f"reusing {len(data)} self-distilled sequences from {cache}")
            return data, eval_prompts
    log(f"self-distillation: {len(prompts)} prompts x {cfg.distill_tokens} greedy target tokens")
    t0 = time.perf_counter()

    def progress(done, total):
        rate = done / max(time.perf_counter() - t0, 1e-9)
        log(f"  distilled {done}/{total} prompts ({rate:.1f}/s)")

    conts = greedy_continuations(
        target.model, prompts, cfg.distill_tokens, eos, cfg.distill_batch, progress
    )
    data = SequenceData([np.array(p + c, np.int32) for p, c in zip(prompts, conts)],
                        [len(p) for p in prompts], pad)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    data.save(cache)
    return data, eval_prompts
