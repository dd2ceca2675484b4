"""The kernel registry: Metal source, pure-MLX reference and dispatch for each kernel.

Dispatch rule (DESIGN.md section 4), checked on every call:

1. ``DFLASH_MLX_REFERENCE`` forces the reference: ``1``/``all`` for every
   kernel, or a comma-separated list of kernel names.
2. The kernel runs only where the backend is available (``mx.metal.is_available()``
   for the real one).
3. Before its first use on a backend the kernel checks itself: it runs on a
   small random input and is compared with the reference. On a mismatch, or if
   it fails to build or run, it warns once and the reference is used from then
   on.
4. Inputs the kernel does not handle (dtype, sizes) go to the reference.

Tests and the emulation harness swap the backend (:func:`use_backend`), which is
how the whole dispatch path, self-check included, runs on Linux.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

REFERENCE_ENV = "DFLASH_MLX_REFERENCE"
HEADER_FILE = "common.h"


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


@dataclass
class KernelSpec:
    """What the registry needs to know about one kernel.

    ``reference(*inputs, **params)`` and the kernel take the same arguments and
    return the same outputs (a tuple). ``kernel_inputs`` turns them into the
    arrays the Metal body sees (in ``input_names`` order); ``configure`` gives
    the launch shape. ``sample(rng)`` makes a small random (inputs, params) for
    the self-check, and ``compare(got, want, inputs, params)`` returns None or
    what is wrong. ``unsupported`` returns why some inputs must go to the
    reference, or None.
    """

    name: str
    source_file: str
    input_names: Sequence[str]
    output_names: Sequence[str]
    reference: Callable[..., tuple]
    kernel_inputs: Callable[..., list]
    configure: Callable[..., Launch]
    sample: Callable[[np.random.Generator], tuple[tuple, dict]]
    compare: Callable[[Sequence[mx.array], Sequence[mx.array], tuple, dict], Optional[str]]
    unsupported: Callable[..., Optional[str]] = lambda *inputs, **params: None
    atomic_outputs: bool = False
    ensure_row_contiguous: bool = True
    description: str = ""


@dataclass
class Backend:
    """Where kernels run: a name, whether it is usable here, and a
    ``metal_kernel`` factory with the signature of ``mx.fast.metal_kernel``."""

    name: str
    available: Callable[[], bool]
    metal_kernel: Callable[..., Any]
    call_options: dict = field(default_factory=dict)


def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


METAL = Backend("metal", _metal_available, lambda **kw: mx.fast.metal_kernel(**kw))
_backend = METAL
_lock = threading.RLock()


def current_backend() -> Backend:
    return _backend


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Run kernels on ``backend`` inside the block (self-checks are per backend)."""
    global _backend
    with _lock:
        previous, _backend = _backend, backend
    try:
        yield backend
    finally:
        with _lock:
            _backend = previous


def emulated_backend(order: str = "shuffle", seed: int = 0, name: Optional[str] = None) -> Backend:
    """The CPU emulation harness as a backend (needs g++)."""
    from .. import emulate

    return Backend(
        name or f"emulated-{order}-{seed}",
        lambda: True,
        lambda **kw: emulate.metal_kernel(**kw),
        {"order": order, "seed": seed},
    )


def forced_reference(name: str) -> bool:
    value = os.environ.get(REFERENCE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "all", "true", "yes", "on"):
        return True
    return name.lower() in {v.strip() for v in value.split(",")}


class Kernel:
    """One registered kernel: its sources, reference, dispatch and self-check state."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.name = spec.name
        self._objects: dict[tuple, Any] = {}
        self._checks: dict[str, Optional[str]] = {}  # backend name -> None (passed) or failure
        self._warned: set[str] = set()

    # ---- sources
    @property
    def source(self) -> str:
        return (metal_dir() / self.spec.source_file).read_text()

    @property
    def header(self) -> str:
        return (metal_dir() / HEADER_FILE).read_text()

    def reference(self, *inputs, **params) -> tuple:
        return tuple(self.spec.reference(*inputs, **params))

    # ---- running the Metal body
    def launch(self, *inputs, backend: Optional[Backend] = None, source: Optional[str] = None, **params) -> tuple:
        """Run the kernel itself on ``backend`` (default: the current one), no checks.
        ``source`` replaces the body (tests use it for mutations)."""
        backend = backend or _backend
        body = self.source if source is None else source
        header = self.header
        key = (backend.name, body, header)
        kernel = self._objects.get(key)
        if kernel is None:
            kernel = backend.metal_kernel(
                name=self.name,
                input_names=list(self.spec.input_names),
                output_names=list(self.spec.output_names),
                source=body,
                header=header,
                ensure_row_contiguous=self.spec.ensure_row_contiguous,
                atomic_outputs=self.spec.atomic_outputs,
            )
            self._objects[key] = kernel
        launch = self.spec.configure(*inputs, **params)
        outputs = kernel(
            inputs=self.spec.kernel_inputs(*inputs, **params),
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
        """Compare kernel and reference on the spec's small random input; None if they agree."""
        backend = backend or _backend
        inputs, params = self.spec.sample(np.random.default_rng(seed))
        try:
            got = self.launch(*inputs, backend=backend, **params)
            want = self.reference(*inputs, **params)
            mx.eval(got, want)
            return self.spec.compare(got, want, inputs, params)
        except Exception as e:  # a kernel that does not build or run is a failed check
            return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"

    def _checked(self, backend: Backend) -> Optional[str]:
        with _lock:
            if backend.name not in self._checks:
                failure = self.self_check(backend)
                self._checks[backend.name] = failure
                if failure is not None and backend.name not in self._warned:
                    self._warned.add(backend.name)
                    warnings.warn(
                        f"dflash-mlx: the {backend.name} kernel '{self.name}' failed its self-check "
                        f"({failure}); using the pure-MLX reference instead",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            return self._checks[backend.name]

    def reset(self) -> None:
        """Forget self-check results and built kernels (tests)."""
        with _lock:
            self._objects.clear()
            self._checks.clear()
            self._warned.clear()

    # ---- dispatch
    def reference_reason(self, *inputs, **params) -> Optional[str]:
        """Why these inputs go to the reference now, or None if the kernel runs."""
        if forced_reference(self.name):
            return f"forced by {REFERENCE_ENV}"
        backend = _backend
        if not backend.available():
            return f"no {backend.name} backend"
        failure = self._checked(backend)
        if failure is not None:
            return f"disabled by self-check: {failure}"
        return self.spec.unsupported(*inputs, **params)

    def active(self, *inputs, **params) -> bool:
        """True if the kernel (not the reference) runs for these inputs."""
        return self.reference_reason(*inputs, **params) is None

    def __call__(self, *inputs, **params) -> tuple:
        if self.active(*inputs, **params):
            return self.launch(*inputs, **params)
        return self.reference(*inputs, **params)

    def status(self, check: bool = True) -> str:
        """'active', 'reference (why)' or 'disabled by self-check (why)' on the current backend.
        With ``check`` the self-check runs now if it has not yet."""
        if forced_reference(self.name):
            return f"reference (forced by {REFERENCE_ENV})"
        backend = _backend
        if not backend.available():
            return f"reference (no {backend.name} backend)"
        if backend.name not in self._checks and not check:
            return "unchecked"
        failure = self._checked(backend)
        if failure is not None:
            return f"disabled by self-check ({failure})"
        return "active"


KERNELS: dict[str, Kernel] = {}


def register(spec: KernelSpec) -> Kernel:
    kernel = Kernel(spec)
    KERNELS[spec.name] = kernel
    return kernel


def get(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"no kernel named '{name}'; registered: {', '.join(sorted(KERNELS))}") from None


# ---- comparison helpers shared by the specs
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
