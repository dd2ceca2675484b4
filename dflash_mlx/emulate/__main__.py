"""``python -m dflash_mlx.emulate [KERNEL ...]``: run registered kernels on the CPU emulator.

Each kernel runs on its self-check input (or several seeds of it) through the
harness and is compared with its pure-MLX reference; the exit status is 1 if
any kernel disagrees or fails to build. ``--source FILE`` runs a modified body
for one kernel.
"""

import argparse
import sys
import time

import numpy as np


def main(argv=None) -> int:
    from .. import kernels
    from . import EmulationError, run_kernel

    parser = argparse.ArgumentParser(prog="python -m dflash_mlx.emulate", description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", help=f"kernel names (default: all of {', '.join(sorted(kernels.KERNELS))})")
    parser.add_argument("--seeds", type=int, default=1, help="random inputs per kernel")
    parser.add_argument("--order", default="shuffle", choices=["forward", "reverse", "shuffle", "simdgroup"],
                        help="order threads run between synchronisation points")
    parser.add_argument("--source", help="a replacement .metal body (one kernel only)")
    args = parser.parse_args(argv)
    names = args.kernels or sorted(kernels.KERNELS)
    if args.source and len(names) != 1:
        parser.error("--source needs exactly one kernel name")
    source = open(args.source).read() if args.source else None
    failed = False
    for name in names:
        kernel = kernels.get(name)
        for seed in range(args.seeds):
            inputs, params = kernel.spec.sample(np.random.default_rng(seed))
            start = time.perf_counter()
            try:
                _, problem = run_kernel(name, *inputs, source=source, order=args.order, seed=seed, **params)
            except EmulationError as e:
                problem = str(e)
            took = time.perf_counter() - start
            verdict = "ok" if problem is None else f"MISMATCH: {problem}"
            print(f"{name} seed {seed}: {verdict} ({took:.2f} s)")
            failed |= problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
