"""Custom Metal kernels: each a :class:`~.registry.Kernel` with its Metal body
under ``metal/`` (shipped in the wheel as ``dflash_mlx/metal``), a pure-MLX
reference with the same semantics, and dispatch through the kernel policy
(docs/architecture.md, "Kernels"). Kernels take and return arrays only.

- ``verify_greedy``: greedy block verification, used by :mod:`dflash_mlx.loop.verify`.
- ``verify_sampled``: rejection-sampling block verification, likewise.
- ``kv_inject``: every draft layer's k_norm + RoPE and K/V layout after one
  stacked projection, used by the draft's injection plan.
- ``qmm_verify``: quantized matmul for the 1..32 rows of a verified block,
  used by the target's verify pass (:mod:`dflash_mlx.targets.verify_matmuls`).
- ``gdn_verify``, ``gdn_replay``: GatedDeltaNet recurrence over a verified
  block and its rollback by replay, used by :mod:`dflash_mlx.targets.gated_delta`.
- ``gdn_tree_verify``: the same recurrence over a DDTree, each node from its
  parent's state, used by :mod:`dflash_mlx.tree.gated_delta`.

On Linux the kernels are proven by running their sources through the CPU
emulation harness: :mod:`.emulated` (``python -m dflash_mlx.kernels``).
"""

from . import gdn, gdn_tree, kv_inject, qmm, verify_greedy, verify_sampled
from .registry import (
    METAL,
    REFERENCE_ENV,
    Backend,
    Kernel,
    KernelPolicy,
    Launch,
    current_policy,
    metal_dir,
    use_backend,
    use_policy,
)

KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (verify_greedy.KERNEL, verify_sampled.KERNEL, kv_inject.KERNEL, qmm.KERNEL, gdn.VERIFY, gdn.REPLAY,
              gdn_tree.KERNEL)
}


def get(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"no kernel named '{name}'; registered: {', '.join(sorted(KERNELS))}") from None


def status(check: bool = True) -> dict[str, str]:
    """Kernel name -> 'active' | 'reference (why)' | 'disabled by self-check (why)'."""
    return {name: kernel.status(check=check) for name, kernel in sorted(KERNELS.items())}


__all__ = [
    "KERNELS", "METAL", "REFERENCE_ENV", "Backend", "Kernel", "KernelPolicy", "Launch",
    "current_policy", "gdn", "gdn_tree", "get", "kv_inject", "metal_dir", "qmm", "status", "use_backend",
    "use_policy", "verify_greedy", "verify_sampled",
]
