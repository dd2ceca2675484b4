"""Custom Metal kernels (DESIGN.md section 4): registry, dispatch and self-checks.

Each kernel has a Metal body under ``metal/`` (shipped in the wheel as
``dflash_mlx/metal``), a pure-MLX reference with the same semantics, and a
dispatcher that runs the kernel only on Metal, only after it passed a one-time
self-check against the reference, and never when ``DFLASH_MLX_REFERENCE`` asks
for the reference (``1``/``all``, or a comma-separated list of kernel names).

Registered kernels:

- ``verify_greedy``: greedy block verification (see :mod:`.verify_greedy`),
  used by :func:`dflash_mlx.verify.greedy_verify`.
- ``kv_inject``: every draft layer's k_norm + RoPE and K/V layout after one
  stacked projection (see :mod:`.kv_inject`), used by ``DFlashDraft.inject``.
- ``verify_sampled``: rejection-sampling block verification (see
  :mod:`.verify_sampled`), used by :func:`dflash_mlx.verify.sampled_verify`.
- ``qmm_verify``: quantized matmul for the 1..32 rows of a verified block (see
  :mod:`.qmm`), used by the target's verify pass and its logits.
- ``gdn_verify``, ``gdn_replay``: GatedDeltaNet recurrence over a verified
  block and its rollback by replay (see :mod:`.gdn`), used by
  :mod:`dflash_mlx.gated_delta`.

On Linux the kernels are proven by running their sources through the CPU
emulation harness (:mod:`dflash_mlx.emulate`): ``with use_backend(emulated_backend()):``.
"""

from . import gdn, kv_inject, qmm, verify_greedy, verify_sampled
from .registry import (
    KERNELS,
    METAL,
    REFERENCE_ENV,
    Backend,
    Kernel,
    KernelSpec,
    Launch,
    current_backend,
    emulated_backend,
    forced_reference,
    get,
    metal_dir,
    use_backend,
)


def status(check: bool = True) -> dict[str, str]:
    """Kernel name -> 'active' | 'reference (why)' | 'disabled by self-check (why)'."""
    return {name: kernel.status(check=check) for name, kernel in sorted(KERNELS.items())}


__all__ = [
    "KERNELS", "METAL", "REFERENCE_ENV", "Backend", "Kernel", "KernelSpec", "Launch",
    "current_backend", "emulated_backend", "forced_reference", "gdn", "get", "kv_inject", "metal_dir", "qmm",
    "status", "use_backend", "verify_greedy", "verify_sampled",
]
