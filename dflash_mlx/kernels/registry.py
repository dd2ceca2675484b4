"""Kernel base class and the dispatch policy: which kernels run, where, and why not.

A kernel is a :class:`Kernel` subclass: its Metal body (a file under
``metal/``), a pure-MLX reference with the same semantics, the launch shape,
and a small random input for its self-check. Kernels take and return arrays;
the model-side plans that feed them live with the models.

Dispatch rule (docs/architecture.md, "Kernels"):

1. The policy may force the reference: ``DFLASH_MLX_REFERENCE`` (``1``/``all``
   for every kernel, or a comma-separated list of names), read once when the
   policy is made.
2. The kernel runs only where the policy's backend is available
   (``mx.metal.is_available()`` for the real one).
3. Before its first use on a backend the kernel checks itself against the
   reference on a small random input. On a mismatch, or if it fails to build
   or run, the policy warns once and the reference is used from then on.
4. Inputs the kernel does not handle (dtype, sizes) go to the reference.

The policy object holds all of that state (self-check results, warnings
given, built kernels). There is one per process by default; ``use_policy`` /
``use_backend`` replace it for the current thread or task only, which is how
tests and the emulation harness run the whole dispatch path on Linux.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

REFERENCE_ENV = "DFLASH_MLX_REFERENCE"
HEADER_FILE = "common.h"
ALL = "*"


def metal_dir() -> Path:
    """The folder with the kernel sources: ``dflash_mlx/metal`` in an installed
    wheel, the repository's top-level ``metal/`` in a source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "metal", package.parent / "metal"):
        if (candidate / HEADER_FILE).is_file():
            return candidate
    raise FileNotFoundError(
        f"dflash-mlx Metal sources not found (looked in {package / 'metal'} and "
        f"{package.parent / 'metal'}); the installation is incomplete"
    )


@dataclass(frozen=True)
class Launch:
    """How to call the kernel for given inputs (the ``mx.fast.metal_kernel`` call arguments)."""

    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: Sequence[Sequence[int]]
    output_dtypes: Sequence[mx.Dtype]
    template: Sequence[tuple[str, Any]] = ()
    init_value: Optional[float] = None


@dataclass(frozen=True)
class Backend:
    """Where kernels run: a name, whether it is usable here, and a
    ``metal_kernel`` factory with the signature of ``mx.fast.metal_kernel``."""

    name: str
    available: Callable[[], bool]
    metal_kernel: Callable[..., Any]
    call_options: Mapping[str, Any] = field(default_factory=dict)


def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


METAL = Backend("metal", _metal_available, lambda **kw: mx.fast.metal_kernel(**kw))


def parse_forced(value: str) -> frozenset[str]:
    """Kernel names a ``DFLASH_MLX_REFERENCE`` value forces to the reference ({ALL} for all)."""
    value = value.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return frozenset()
    if value in ("1", "all", "true", "yes", "on"):
        return frozenset({ALL})
    return frozenset(v.strip() for v in value.split(",") if v.strip())


@dataclass
class KernelPolicy:
    """Where kernels run, which are forced to their reference, and what the
    self-checks found. All dispatch state lives here."""

    backend: Backend = METAL
    forced: frozenset[str] = frozenset()
    checks: dict[tuple[str, str], Optional[str]] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)
    built: dict[tuple, Any] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, backend: Backend = METAL) -> "KernelPolicy":
        return cls(backend, parse_forced(environ.get(REFERENCE_ENV, "")))

    def forces(self, name: str) -> bool:
        return ALL in self.forced or name.lower() in self.forced

    def warn_once(self, key: str, message: str, stacklevel: int = 3) -> None:
        """Warn with ``message`` the first time ``key`` is seen by this policy."""
        with self.lock:
            if key in self.warned:
                return
            self.warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


_default: Optional[KernelPolicy] = None
_default_lock = threading.Lock()
_current: contextvars.ContextVar[Optional[KernelPolicy]] = contextvars.ContextVar(
    "dflash_mlx_kernel_policy", default=None
)


def current_policy() -> KernelPolicy:
    """The policy in force: the one ``use_policy`` set here, else the process's
    (made from the environment on first use)."""
    global _default
    policy = _current.get()
    if policy is not None:
        return policy
    with _default_lock:
        if _default is None:
            _default = KernelPolicy.from_env()
        return _default


@contextlib.contextmanager
def use_policy(policy: KernelPolicy) -> Iterator[KernelPolicy]:
    """Dispatch with ``policy`` inside the block (this thread or task only)."""
    token = _current.set(policy)
    try:
        yield policy
    finally:
        _current.reset(token)


def use_backend(backend: Backend):
    """Run kernels on ``backend`` inside the block, with fresh self-checks and
    the current policy's forced kernels."""
    return use_policy(KernelPolicy(backend, current_policy().forced))


class Kernel:
    """One custom kernel. Subclasses set the class attributes and define
    ``reference``, ``configure`` and ``sample``; the rest has defaults.

    ``reference(*inputs, **params)`` and the kernel take the same arguments and
    return the same outputs (a tuple). ``kernel_inputs`` turns them into the
    arrays the Metal body sees (in ``input_names`` order); ``configure`` gives
    the launch shape; ``sample(rng)`` makes a small random (inputs, params) for
    the self-check; ``compare(got, want, inputs, params)`` returns None or what
    is wrong; ``unsupported`` returns why some inputs must go to the reference.
    """

    name: str
    source_file: str
    input_names: Sequence[str]
    output_names: Sequence[str]
    atomic_outputs: bool = False
    ensure_row_contiguous: bool = True
    description: str = ""

    # ---- what a kernel defines
    def reference(self, *inputs, **params) -> tuple:
        raise NotImplementedError

    def configure(self, *inputs, **params) -> Launch:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        raise NotImplementedError

    def kernel_inputs(self, *inputs, **params) -> list:
        return list(inputs)

    def compare(self, got: Sequence[mx.array], want: Sequence[mx.array], inputs: tuple, params: dict) -> Optional[str]:
        """Exact agreement of every output, by default."""
        for name, g, w in zip(self.output_names, got, want):
            problem = mismatch(name, g, w)
            if problem:
                return problem
        return None

    def unsupported(self, *inputs, **params) -> Optional[str]:
        return None

    # ---- sources
    @property
    def source(self) -> str:
        return (metal_dir() / self.source_file).read_text()

    @property
    def header(self) -> str:
        return (metal_dir() / HEADER_FILE).read_text()

    # ---- running the Metal body
    def launch(self, *inputs, backend: Optional[Backend] = None, source: Optional[str] = None, **params) -> tuple:
        """Run the kernel itself on ``backend`` (default: the policy's), no checks.
        ``source`` replaces the body (tests use it for mutations)."""
        policy = current_policy()
        backend = backend or policy.backend
        body = self.source if source is None else source
        header = self.header
        key = (self.name, backend.name, body, header)
        kernel = policy.built.get(key)
        if kernel is None:
            kernel = backend.metal_kernel(
                name=self.name,
                input_names=list(self.input_names),
                output_names=list(self.output_names),
                source=body,
                header=header,
                ensure_row_contiguous=self.ensure_row_contiguous,
                atomic_outputs=self.atomic_outputs,
            )
            policy.built[key] = kernel
        launch = self.configure(*inputs, **params)
        outputs = kernel(
            inputs=self.kernel_inputs(*inputs, **params),
            template=list(launch.template),
            grid=tuple(launch.grid),
            threadgroup=tuple(launch.threadgroup),
            output_shapes=[tuple(s) for s in launch.output_shapes],
            output_dtypes=list(launch.output_dtypes),
            init_value=launch.init_value,
            **backend.call_options,
        )
        return tuple(outputs)

    # ---- self-check
    def self_check(self, backend: Optional[Backend] = None, seed: int = 0) -> Optional[str]:
        """Compare kernel and reference on the small random input; None if they agree."""
        inputs, params = self.sample(np.random.default_rng(seed))
        try:
            got = self.launch(*inputs, backend=backend, **params)
            want = self.reference(*inputs, **params)
            mx.eval(got, want)
            return self.compare(got, want, inputs, params)
        except Exception as e:  # a kernel that does not build or run is a failed check
            return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"

    def _checked(self, policy: KernelPolicy) -> Optional[str]:
        key = (self.name, policy.backend.name)
        with policy.lock:
            if key not in policy.checks:
                policy.checks[key] = failure = self.self_check(policy.backend)
                if failure is not None:
                    policy.warn_once(
                        f"self-check:{key}",
                        f"dflash-mlx: the {policy.backend.name} kernel '{self.name}' failed its "
                        f"self-check ({failure}); using the pure-MLX reference instead",
                        stacklevel=4,
                    )
            return policy.checks[key]

    # ---- dispatch
    def disabled_reason(self, check: bool = True) -> Optional[str]:
        """Why this kernel cannot run here at all (whatever the inputs), or None.
        Without ``check`` a kernel not yet self-checked reports 'unchecked'."""
        policy = current_policy()
        if policy.forces(self.name):
            return f"forced by {REFERENCE_ENV}"
        if not policy.backend.available():
            return f"no {policy.backend.name} backend"
        if not check and (self.name, policy.backend.name) not in policy.checks:
            return "unchecked"
        failure = self._checked(policy)
        return None if failure is None else f"disabled by self-check: {failure}"

    def enabled(self) -> bool:
        """Whether the kernel runs here for the inputs it supports."""
        return self.disabled_reason() is None

    def reference_reason(self, *inputs, **params) -> Optional[str]:
        """Why these inputs go to the reference now, or None if the kernel runs."""
        return self.disabled_reason() or self.unsupported(*inputs, **params)

    def active(self, *inputs, **params) -> bool:
        """True if the kernel (not the reference) runs for these inputs."""
        return self.reference_reason(*inputs, **params) is None

    def __call__(self, *inputs, **params) -> tuple:
        if self.active(*inputs, **params):
            return self.launch(*inputs, **params)
        return self.reference(*inputs, **params)

    def status(self, check: bool = True) -> str:
        """'active', 'reference (why)', 'disabled by self-check (why)' or 'unchecked'
        on the current policy. With ``check`` the self-check runs now if it has not yet."""
        reason = self.disabled_reason(check=check)
        if reason is None:
            return "active"
        if reason == "unchecked":
            return reason
        if reason.startswith("disabled by self-check: "):
            return f"disabled by self-check ({reason.split(': ', 1)[1]})"
        return f"reference ({reason})"


# ---- comparison helpers shared by the kernels
TOLERANCES = {  # (rtol, atol) for values of order one
    mx.float32: (1e-5, 1e-5),
    mx.float16: (2e-3, 2e-3),  # 2 ulp of half (2^-10 = 9.8e-4)
    mx.bfloat16: (1.6e-2, 1.6e-2),  # 2 ulp of bfloat16 (2^-7 = 7.8e-3)
}


def mismatch(name: str, got: mx.array, want: mx.array, rtol: float = 0.0, atol: float = 0.0) -> Optional[str]:
    """None if ``got`` matches ``want`` (shape, dtype, |got - want| <= atol + rtol |want|)."""
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype} != {want.dtype}"
    g = np.array(got.astype(mx.float32) if got.dtype == mx.bfloat16 else got)
    w = np.array(want.astype(mx.float32) if want.dtype == mx.bfloat16 else want)
    if rtol == 0 and atol == 0:
        same = (g == w) | (np.isnan(g) & np.isnan(w)) if g.dtype.kind == "f" else g == w
        bad = ~same
    else:
        g, w = g.astype(np.float64), w.astype(np.float64)
        bad = ~(np.abs(g - w) <= atol + rtol * np.abs(w))
        bad &= ~(np.isnan(g) & np.isnan(w))
    if not bad.any():
        return None
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    return (
        f"{name}: {int(bad.sum())} of {bad.size} elements differ "
        f"(first at {first}: {g[first]!r} vs {w[first]!r})"
    )
