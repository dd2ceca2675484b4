"""Reading JSON Lines files (prompt sets, training records) with one-line errors."""

import json
from pathlib import Path
from typing import Any, Iterator

from .errors import DFlashError


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, object) for every non-blank line of ``path``; a file that
    cannot be read, is not UTF-8 or holds a line that is not JSON is a
    DFlashError naming the file (and line)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DFlashError(f"cannot read '{path}': {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise DFlashError(f"'{path}' is not valid UTF-8") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DFlashError(f"{path}:{n}: not valid JSON ({e.msg})") from None
