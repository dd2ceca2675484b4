"""The bridge between the kernels and the CPU emulation harness.

:mod:`dflash_mlx.emulate` knows nothing of this package (it is a drop-in for
``mx.fast.metal_kernel``); this module makes it a kernel backend and runs the
registered kernels through it against their references.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import numpy as np

from .. import emulate
from . import KERNELS, get
from .registry import Backend


def emulated_backend(order: str = "shuffle", seed: int = 0, name: Optional[str] = None) -> Backend:
    """The CPU emulation harness as a backend (needs g++)."""
    return Backend(
        name or f"emulated-{order}-{seed}",
        lambda: True,
        lambda **kw: emulate.metal_kernel(**kw),
        {"order": order, "seed": seed},
    )


def run_kernel(name: str, *inputs, source: Optional[str] = None, order: str = "shuffle",
               seed: int = 0, compare: bool = True, **params):
    """Run registered kernel ``name`` through the harness on ``inputs``/``params``
    (the same arguments the kernel's dispatcher takes) and, with ``compare``,
    check it against the pure-MLX reference. ``source`` replaces the kernel body
    (to test mutations). Returns (emulated outputs, mismatch message or None).
    """
    kernel = get(name)
    got = kernel.launch(*inputs, backend=emulated_backend(order=order, seed=seed), source=source, **params)
    if not compare:
        return got, None
    want = kernel.reference(*inputs, **params)
    return got, kernel.compare(got, want, inputs, params)


def main(argv=None) -> int:
    """``python -m dflash_mlx.kernels [KERNEL ...]``: each kernel on its self-check
    input (or several seeds of it) through the harness, against its reference.
    Exit status 1 if any kernel disagrees or fails to build."""
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mlx.kernels",
        description="Run the Metal kernels' sources on the CPU emulator against their references.",
    )
    parser.add_argument("kernels", nargs="*", help=f"kernel names (default: all of {', '.join(sorted(KERNELS))})")
    parser.add_argument("--seeds", type=int, default=1, help="random inputs per kernel")
    parser.add_argument("--order", default="shuffle", choices=["forward", "reverse", "shuffle", "simdgroup"],
                        help="order threads run between synchronisation points")
    parser.add_argument("--source", help="a replacement .metal body (one kernel only)")
    args = parser.parse_args(argv)
    names = args.kernels or sorted(KERNELS)
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        parser.error(f"unknown kernel {', '.join(unknown)}; registered: {', '.join(sorted(KERNELS))}")
    if args.source and len(names) != 1:
        parser.error("--source needs exactly one kernel name")
    source = open(args.source).read() if args.source else None
    failed = False
    for name in names:
        kernel = get(name)
        for seed in range(args.seeds):
            inputs, params = kernel.sample(np.random.default_rng(seed))
            start = time.perf_counter()
            try:
                _, problem = run_kernel(name, *inputs, source=source, order=args.order, seed=seed, **params)
            except emulate.EmulationError as e:
                problem = str(e)
            took = time.perf_counter() - start
            verdict = "ok" if problem is None else f"MISMATCH: {problem}"
            print(f"{name} seed {seed}: {verdict} ({took:.2f} s)")
            failed |= problem is not None
    return 1 if failed else 0
