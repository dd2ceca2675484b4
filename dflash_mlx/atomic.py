"""Atomic directory output, shared by ``convert`` and ``train``.

A directory is written into a staging directory beside it,
``.<name>.dflash-partial``, and renamed into place only when complete, so a
failure, Ctrl-C or a kill never leaves a half-written output. The staging name
is fixed, so a later run finds what a killed one left behind and removes it.
An existing output is replaced only when asked (``force``) and only if it is
recognisably one of ours (see ``docs/architecture.md``).
"""

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .errors import DFlashError

MARKER = ".dflash-mlx-output"  # written into every output, so --force can recognise it
PARTIAL_SUFFIX = ".dflash-partial"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def staging_path(out: Path) -> Path:
    """Where ``out`` is written before it is renamed into place."""
    out = Path(os.path.abspath(Path(out).expanduser()))
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def is_ours(path: Path) -> bool:
    """True for a directory that dflash-mlx wrote: it holds our marker or a draft config."""
    path = Path(path)
    if (path / MARKER).is_file():
        return True
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "dflash_config" in config


def _within(path: Path, protected: Path) -> bool:
    return path == protected or path in protected.parents


def check_output(out: Path, force: bool, sources: Sequence[Path] = ()) -> None:
    """Raise a one-line DFlashError unless ``out`` may be written.

    Never the current directory, a source or a parent of either; an existing
    ``out`` only with ``force`` and only if ``is_ours``.
    """
    out = Path(out).expanduser()
    real = out.resolve()
    if _within(real, Path.cwd().resolve()):
        raise DFlashError(f"output '{out}' is the current directory or a parent of it; choose another")
    for src in sources:
        if _within(real, Path(src).expanduser().resolve()):
            raise DFlashError(f"output '{out}' would replace the source '{src}'; choose another")
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise DFlashError(f"output '{out}' already exists; pass --force to replace it")
    if not is_ours(out):
        raise DFlashError(
            f"output '{out}' exists and is not a dflash-mlx output (no {MARKER} or draft "
            "config.json); remove it yourself or choose another"
        )


def remove_stale(out: Path, log: Callable[[str], None] = _stderr) -> None:
    """Remove the staging directory an interrupted run left for ``out``.

    An older output that was moved aside when the run died (``out`` missing)
    is put back first.
    """
    out = Path(os.path.abspath(Path(out).expanduser()))
    staging = staging_path(out)
    if not (staging.exists() or staging.is_symlink()):
        return
    aside = staging / "replaced"
    if aside.is_dir() and not (out.exists() or out.is_symlink()):
        os.rename(aside, out)
        log(f"restored '{out}', which an interrupted run had moved aside")
    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging)
    else:
        staging.unlink()
    log(f"removed '{staging}', a partial output left by an interrupted run")


@contextmanager
def staged_output(
    out: Path, force: bool = False, sources: Sequence[Path] = (),
    log: Callable[[str], None] = _stderr,
) -> Iterator[Path]:
    """Yield a not-yet-existing directory path to write; it becomes ``out`` only if
    the block succeeds.

    What an interrupted run left is cleaned up first (``remove_stale``), then
    ``out`` is checked (``check_output``). On any exception, Ctrl-C included,
    the staging directory is removed and ``out`` is left as it was.
    """
    out = Path(os.path.abspath(Path(out).expanduser()))
    remove_stale(out, log)
    check_output(out, force, sources)
    staging = staging_path(out)
    staging.mkdir(parents=True)
    try:
        new = staging / out.name
        yield new
        if not new.is_dir():
            raise DFlashError(f"nothing was written for '{out}'")
        (new / MARKER).write_text("written by dflash-mlx; `--force` may replace this directory\n")
        _swap_in(new, out, staging / "replaced")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(new: Path, out: Path, aside: Path) -> None:
    if out.exists() or out.is_symlink():
        os.rename(out, aside)
    try:
        os.rename(new, out)
    except BaseException:
        if aside.exists() or aside.is_symlink():
            os.rename(aside, out)
        raise


@contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write; it replaces ``path`` only if the
    block succeeds, and is removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write a small text file whole (``staged_file``)."""
    with staged_file(path) as tmp:
        tmp.write_text(text)
