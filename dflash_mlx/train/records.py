"""Training text: files and directories read into records (plain text, prompt /
completion pairs or chat messages), and records turned into token ids."""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..chat import template_ids
from ..errors import DFlashError
from ..jsonl import read_jsonl

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
            records += [_jsonl_record(obj, f"{f}:{n}") for n, obj in read_jsonl(f)]
        else:
            text = f.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                records.append(Record(text=text))
    if not records:
        raise DFlashError("the training data holds no text")
    return records


def _chat(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    """Ids of a conversation exactly as generation would tokenize it."""
    return template_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt)


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
