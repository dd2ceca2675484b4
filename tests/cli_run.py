"""The CLI as a user runs it, for tests: a subprocess, and the one-error-line rule."""

import subprocess
import sys


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    """``python -m dflash_mlx ARGS`` with text output, bounded by ``timeout``."""
    return subprocess.run([sys.executable, "-m", "dflash_mlx", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(run: subprocess.CompletedProcess, wanted: str) -> None:
    """Exit status 1 and exactly one stderr line, an ``error:`` naming ``wanted``."""
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and wanted in lines[0], run.stderr
