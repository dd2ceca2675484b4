"""Training data for DFlash drafts: a text/JSONL corpus, or the target's own
greedy continuations of prompts (self-distillation, the published recipe).

Both kinds are sampled by a pure function of a NumPy generator, so a training
step's batch depends only on (seed, step, micro-batch) and resuming is exact.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .errors import DFlashError

TEXT_SUFFIXES_SKIPPED = {".npy", ".npz", ".safetensors", ".bin", ".gz", ".zip", ".pyc"}


@dataclass
class Record:
    """One corpus entry: plain text, or a prompt with an optional completion."""

    text: Optional[str] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None
    messages: Optional[list] = None


def _files(paths: Sequence[str]) -> list[Path]:
    out = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            out += sorted(
                f for f in p.rglob("*")
                if f.is_file() and f.suffix not in TEXT_SUFFIXES_SKIPPED and not f.name.startswith(".")
            )
        elif p.is_file():
            out.append(p)
        else:
            raise DFlashError(f"training data '{raw}' does not exist")
    if not out:
        raise DFlashError("no training data files found in " + ", ".join(map(str, paths)))
    return out


def _jsonl_record(obj, where: str) -> Record:
    if isinstance(obj, str):
        return Record(text=obj)
    if not isinstance(obj, dict):
        raise DFlashError(f"{where}: expected a JSON object or string")
    if "messages" in obj:
        return Record(messages=list(obj["messages"]))
    if "prompt" in obj:
        completion = obj.get("completion", obj.get("response"))
        return Record(prompt=str(obj["prompt"]), completion=None if completion is None else str(completion))
    if "text" in obj:
        return Record(text=str(obj["text"]))
    raise DFlashError(f"{where}: a record needs 'text', 'prompt' or 'messages'")


def read_records(paths: Sequence[str]) -> list[Record]:
    """Files and directories (recursively, sorted): ``.jsonl`` lines are records
    (``text``, ``prompt``/``completion``, or chat ``messages``); any other file
    is one text document."""
    records = []
    for f in _files(paths):
        if f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DFlashError(f"{f}:{n}: invalid JSON ({e.msg})") from None
                records.append(_jsonl_record(obj, f"{f}:{n}"))
        else:
            text = f.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                records.append(Record(text=text))
    if not records:
        raise DFlashError("the training data holds no text")
    return records


def _chat(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        text = "\n".join(str(m.get("content", "")) for m in messages)
        return tokenizer.encode(text)
    return list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    ))


def record_ids(tokenizer, record: Record) -> tuple[list[int], int]:
    """(token ids, prompt length) of a record; plain text has a prompt length of 1."""
    if record.messages is not None:
        msgs = record.messages
        if msgs and msgs[-1].get("role") == "assistant":
            prompt = _chat(tokenizer, msgs[:-1], True)
            full = _chat(tokenizer, msgs, False)
            return full, len(prompt)
        return _chat(tokenizer, msgs, True), None
    if record.prompt is not None:
        prompt = tokenizer.encode(record.prompt)
        if record.completion is None:
            return prompt, None
        full = tokenizer.encode(record.prompt + record.completion)
        return full, len(prompt)
    return tokenizer.encode(record.text), 1


def prompt_ids(tokenizer, record: Record) -> Optional[list[int]]:
    """Prompt ids of a prompt-like record (None for plain text)."""
    if record.messages is not None:
        msgs = record.messages
        if msgs and msgs[-1].get("role") == "assistant":
            msgs = msgs[:-1]
        return _chat(tokenizer, msgs, True)
    if record.prompt is not None:
        return tokenizer.encode(record.prompt)
    return None


# ----------------------------------------------------------------------------
# datasets


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
        tmp = Path(str(path) + ".tmp.npz")
        np.savez(tmp, tokens=flat, lengths=lengths, prompt_lens=self.prompt_lens)
        tmp.replace(path)

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
