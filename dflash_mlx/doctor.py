"""``dflash-mlx doctor``: what this machine runs and why.

Reports the platform, the MLX version and backend, whether Metal is available,
the dtype drafts compute in, each custom kernel's status (active, reference and why, or disabled by its
self-check), and on Linux which BLAS MLX's CPU backend is using, with how to
get OpenBLAS when it is the slow reference one.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

OPENBLAS_PACKAGE = "libopenblas0-pthread"
OPENBLAS_LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
OPENBLAS_EXIT_NOTE = ("dflash-mlx waits for MLX's queued work before it exits; a script of your own must "
                      "too (mx.synchronize on each stream it used), or OpenBLAS can hang at exit")


def _mapped_libraries() -> list[str]:
    """Shared objects mapped into this process (Linux /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def blas_report(libraries: Optional[list[str]] = None) -> tuple[str, Optional[str]]:
    """(which BLAS is loaded, advice or None) for MLX's Linux CPU backend."""
    import mlx.core as mx

    a = mx.ones((8, 8))
    mx.eval(a @ a)  # make sure the BLAS MLX uses is loaded
    libraries = _mapped_libraries() if libraries is None else libraries
    # numpy/scipy wheels bundle an OpenBLAS with prefixed symbols (scipy_openblas):
    # it is mapped but never serves MLX's cblas calls, so it does not count
    openblas = [p for p in libraries
                if "openblas" in Path(p).as_posix().lower() and "scipy_openblas" not in p]
    if openblas:
        return f"OpenBLAS ({openblas[0]})", None
    bundled = [p for p in libraries if "libblas" in Path(p).name and "mlx" in p]
    which = f"reference BLAS bundled with mlx[cpu] ({bundled[0]})" if bundled else "reference BLAS (no OpenBLAS loaded)"
    if Path(OPENBLAS_LIB).exists():
        advice = (f"OpenBLAS is installed but not loaded; export LD_PRELOAD={OPENBLAS_LIB} "
                  f"for much faster float32 matmuls")
    else:
        advice = (f"for much faster float32 matmuls install OpenBLAS (Debian/Ubuntu: "
                  f"sudo apt-get install {OPENBLAS_PACKAGE}) and export LD_PRELOAD={OPENBLAS_LIB}")
    return which, advice


def collect(check: bool = True) -> list[tuple[str, str]]:
    """The report as (label, value) rows. ``check`` runs the kernels' self-checks
    now where Metal is available (otherwise nothing is run)."""
    import mlx.core as mx

    from . import kernels

    rows: list[tuple[str, str]] = []
    rows.append(("platform", f"{platform.system()} {platform.release()} ({platform.machine()})"))
    rows.append(("python", sys.version.split()[0]))
    rows.append(("mlx", mx.__version__))
    metal = False
    try:
        metal = bool(mx.metal.is_available())
    except Exception:
        pass
    cuda = False
    try:
        cuda = bool(mx.cuda.is_available())
    except Exception:
        pass
    backend = "metal (GPU)" if metal else ("cuda (GPU)" if cuda else "cpu")
    rows.append(("mlx backend", f"{backend}; default device {mx.default_device()}"))
    if metal:
        try:
            info = mx.metal.device_info()
            rows.append(("metal", f"available: {info.get('architecture', '?')}, "
                                  f"{info.get('memory_size', 0) / 2**30:.0f} GB"))
        except Exception:
            rows.append(("metal", "available"))
    else:
        rows.append(("metal", "not available (kernels use their pure-MLX references)"))
    from .precision import choose_draft_dtype, device_description

    rows.append(("draft dtype", f"{choose_draft_dtype(device_description())[1]} (override: --draft-dtype)"))
    forced = kernels.current_policy().forced
    if forced:
        rows.append((kernels.REFERENCE_ENV, "all" if kernels.registry.ALL in forced else ",".join(sorted(forced))))
    for name, state in kernels.status(check=check).items():
        rows.append((f"kernel {name}", state))
    if platform.system() == "Linux":
        which, advice = blas_report()
        rows.append(("blas", which))
        if advice:
            rows.append(("blas advice", advice))
        elif which.startswith("OpenBLAS"):
            rows.append(("blas exit", OPENBLAS_EXIT_NOTE))
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    rows.append(("emulation harness", f"C++ compiler {compiler}" if compiler else
                 "no C++ compiler (python -m dflash_mlx.kernels needs g++)"))
    return rows


def main(check: bool = True, echo: Callable[[str], None] = print) -> int:
    rows = collect(check=check)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        echo(f"{label:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
