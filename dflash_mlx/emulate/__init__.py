"""Run Metal kernel sources on the CPU: the emulation harness (a dev tool).

``mx.fast.metal_kernel`` only runs on Apple GPUs. This module takes the same
kernel body, wraps it in the signature MLX would generate for it (inputs,
``*_shape``/``*_strides``/``*_ndim`` where the body mentions them, outputs,
template parameters and the thread-position attributes it uses; see MLX's
``mlx/fast.cpp`` ``write_signature``), compiles it as C++17 with the system
``g++`` against ``metal_emu.h`` and runs the grid on the CPU, each threadgroup's
threads as cooperating fibers so that barriers and 32-lane SIMD-group functions
behave as on the GPU. Outputs are poisoned (NaN / all-ones bytes) before a run
unless ``init_value`` is given, and guard bytes around them catch writes out of
bounds. Compiled objects are cached by source hash under
``$DFLASH_MLX_EMULATE_CACHE`` (default ``~/.cache/dflash-mlx/emulate``).

:func:`metal_kernel` is a drop-in for ``mx.fast.metal_kernel``: same
arguments, and the returned object is called the same way. This module imports nothing of the package: ``dflash_mlx/kernels/emulated.py`` makes it
a kernel backend, runs registered kernels through it against their references
(``run_kernel``), and is what ``python -m dflash_mlx.kernels`` runs.

The one rewrite of the source: a threadgroup array declaration
``threadgroup T name[N];`` becomes a reference into memory shared by the
threads of the current threadgroup. It must be a single declarator.

Differences from the GPU, besides speed: inputs always arrive row-contiguous
(``*_strides`` describe that copy, as with ``ensure_row_contiguous=True``);
float math is IEEE single precision with correctly rounded libm functions, so
transcendental results may differ from Metal's in the last bits; lanes of a
SIMD-group do not run in lockstep, so code that relies on lockstep without a
barrier shows up as a race. ``simdgroup_matrix`` 8x8 load / store /
multiply-accumulate are SIMD-group collectives over lanes that each hold two
elements; their summation order is not the GPU's (results agree to rounding).
Orders: ``forward``, ``reverse``, ``shuffle`` run every ready thread to its next
synchronisation point in that order; ``simdgroup`` lets one SIMD-group at a time
run as far as it can alone, which exposes a missing threadgroup barrier between
SIMD-groups that exchange data through threadgroup memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from .source import _TYPES, EmulationError, _template_value, rewrite_threadgroup, write_signature

HEADER = Path(__file__).with_name("metal_emu.h")
CACHE_ENV = "DFLASH_MLX_EMULATE_CACHE"
WORKERS_ENV = "DFLASH_MLX_EMULATE_WORKERS"
CXX_FLAGS = [
    "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread",
    # Metal has no double: unsuffixed literals such as 0.5 are float there
    "-fsingle-precision-constant",
    # no FMA contraction: keep float rounding as written
    "-ffp-contract=off",
    "-Wno-attributes", "-w",
]
ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2, "simdgroup": 3}  # metal_emu.h enum Order
GUARD_BYTES = 64
_GUARD = 0xA5

def _cxx() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise EmulationError("no C++ compiler found (install g++ or set CXX)")
    return cxx


_cxx_version_cache: dict[str, str] = {}


def _cxx_version(cxx: str) -> str:
    if cxx not in _cxx_version_cache:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        _cxx_version_cache[cxx] = out.stdout.splitlines()[0] if out.stdout else cxx
    return _cxx_version_cache[cxx]


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-mlx" / "emulate"


_libs: dict[str, ctypes.CDLL] = {}
_lib_lock = threading.Lock()
RUNTIME_LIB = "libdflash_emu.so"


def _build(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = "\n".join(proc.stderr.splitlines()[:40])
        raise EmulationError(f"{what}: g++ failed to compile:\n{errors}")


def _runtime(cxx: str, header: str, directory: Path) -> Path:
    """The folder with the header, its precompiled form and the runtime library,
    built once per header version: kernels then compile in a fraction of the time."""
    key = hashlib.sha256("\0".join([header, " ".join(CXX_FLAGS), _cxx_version(cxx)]).encode()).hexdigest()[:16]
    rt = directory / f"runtime-{key}"
    if (rt / RUNTIME_LIB).exists():
        return rt
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix="runtime-tmp-"))
    try:
        (tmp / HEADER.name).write_text(header)
        (tmp / "runtime.cpp").write_text(f'#define EMU_RUNTIME_IMPL\n#include "{HEADER.name}"\n')
        flags = [f for f in CXX_FLAGS if f not in ("-shared", "-O1")]
        _build([cxx, *flags, "-O2", "-shared", str(tmp / "runtime.cpp"), "-o", str(tmp / RUNTIME_LIB)],
               "emulation runtime")
        try:  # a precompiled header (g++ picks it up next to the header); optional
            _build([cxx, *[f for f in CXX_FLAGS if f != "-shared"], "-x", "c++-header",
                    str(tmp / HEADER.name), "-o", str(tmp / (HEADER.name + ".gch"))], "precompiled header")
        except EmulationError:
            pass
        try:
            os.replace(tmp, rt)  # atomic: a concurrent build either wins or loses whole
        except OSError:
            pass  # another process installed the same runtime first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rt


def compile_source(cpp: str, label: str = "kernel") -> ctypes.CDLL:
    """Compile (or fetch from the cache) a translation unit that includes metal_emu.h."""
    cxx = _cxx()
    header = HEADER.read_text()
    key = hashlib.sha256(
        "\0".join([cpp, header, " ".join(CXX_FLAGS), _cxx_version(cxx)]).encode()
    ).hexdigest()[:32]
    with _lib_lock:
        if key in _libs:
            return _libs[key]
        directory = cache_dir()
        rt = _runtime(cxx, header, directory)
        lib_path = directory / f"{label}-{key}.so"
        if not lib_path.exists():
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                src = Path(tmp) / f"{label}.cpp"
                src.write_text(cpp)
                out = Path(tmp) / "out.so"
                _build([cxx, *CXX_FLAGS, "-I", str(rt), str(src), "-o", str(out),
                        "-L", str(rt), f"-l:{RUNTIME_LIB}", f"-Wl,-rpath,{rt}"], label)
                os.replace(out, lib_path)  # atomic: concurrent runs never see half a file
        lib = ctypes.CDLL(str(lib_path))
        lib.emu_launch.restype = ctypes.c_int
        lib.emu_launch.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong),
            ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
            ctypes.c_char_p, ctypes.c_int,
        ]
        _libs[key] = lib
        return lib


def _to_numpy(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.ascontiguousarray(np.array(x))


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _default_workers() -> int:
    env = os.environ.get(WORKERS_ENV)
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


class EmulatedKernel:
    """What :func:`metal_kernel` returns; call it like MLX's kernel object."""

    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, compile_options=None):
        if not output_names:
            raise EmulationError("metal_kernel needs at least one output")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options

    def translation_unit(self, inputs, output_dtypes, template=()) -> tuple[str, list]:
        """The C++ file for these input/output types: header, signature, body, launcher."""
        template = list(template or [])
        func = f"custom_kernel_{self.name}"
        signature, params, attrs, layout = write_signature(
            func, self.source, self.input_names, inputs, self.output_names,
            output_dtypes, template, self.atomic_outputs,
        )
        call_args = [f"{p.cast}bufs[{k}]" for k, p in enumerate(params)]
        call_args += [f"a.{attr}" for attr in attrs]
        targs = "<" + ", ".join(_template_value(v) for _, v in template) + ">" if template else ""
        cpp = "\n".join([
            '#include "metal_emu.h"',
            "// ---- header",
            rewrite_threadgroup(self.header),
            "// ---- signature as MLX writes it (mlx/fast.cpp write_signature)",
            signature,
            f'#line 1 "{self.name}.metal"',
            rewrite_threadgroup(self.source),
            "}",
            "// ---- launcher",
            'extern "C" int emu_launch(void** bufs, const long long* grid, const long long* tg, '
            "int order, unsigned long long seed, int workers, char* err, int errlen) {",
            "  return emu::launch(grid, tg, order, seed, workers, err, errlen, [bufs](const emu::Attrs& a) {",
            f"    (void)a; {func}{targs}({', '.join(call_args)});",
            "  });",
            "}",
            "",
        ])
        return cpp, layout

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None,
                 order: str = "shuffle", seed: int = 0, workers: Optional[int] = None):
        inputs = list(inputs)
        if len(inputs) != len(self.input_names):
            raise EmulationError(f"{self.name}: expected {len(self.input_names)} inputs, got {len(inputs)}")
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise EmulationError(f"{self.name}: expected {len(self.output_names)} output shapes and dtypes")
        if order not in ORDERS:
            raise EmulationError(f"order must be one of {sorted(ORDERS)}")
        cpp, layout = self.translation_unit(inputs, output_dtypes, template)
        if verbose:
            print(cpp)
        lib = compile_source(cpp, label=re.sub(r"\W", "_", self.name))

        keep: list[np.ndarray] = []  # everything the C++ side points into
        host_inputs = [_to_numpy(x) for x in inputs]
        outputs: list[np.ndarray] = []
        backings: list[np.ndarray] = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            np_dtype = _TYPES[dtype][1]
            size = int(np.prod(shape, dtype=np.int64))
            nbytes = size * np.dtype(np_dtype).itemsize
            backing = np.full(nbytes + 2 * GUARD_BYTES, _GUARD, dtype=np.uint8)
            body = backing[GUARD_BYTES:GUARD_BYTES + nbytes].view(np_dtype)
            if init_value is None:
                body.view(np.uint8)[:] = 0xFF  # NaN for floats, -1 / max for integers
            else:
                body[:] = np.asarray(init_value).astype(np_dtype)
            backings.append(backing)
            outputs.append(body.reshape(shape))

        table = []
        for index, role in layout:
            if index < 0:
                table.append(outputs[-1 - index].ctypes.data)
                continue
            arr = host_inputs[index]
            if role == "data":
                table.append(arr.ctypes.data if arr.size else 0)
                continue
            if role == "shape":
                extra = np.asarray(arr.shape, dtype=np.int32)
            elif role == "strides":
                extra = np.asarray([s // arr.itemsize for s in arr.strides], dtype=np.int64)
            else:
                extra = np.asarray(arr.ndim, dtype=np.int32)
            keep.append(extra)
            table.append(extra.ctypes.data)
        table_c = (ctypes.c_void_p * max(1, len(table)))(*table)
        grid_c = (ctypes.c_longlong * 3)(*[int(v) for v in grid])
        tg_c = (ctypes.c_longlong * 3)(*[int(v) for v in threadgroup])
        err = ctypes.create_string_buffer(4096)
        rc = lib.emu_launch(
            table_c, grid_c, tg_c, ORDERS[order], seed,
            workers or _default_workers(), err, len(err),
        )
        if rc != 0:
            raise EmulationError(f"{self.name}: {err.value.decode(errors='replace')}")
        for name, backing in zip(self.output_names, backings):
            if (backing[:GUARD_BYTES] != _GUARD).any() or (backing[-GUARD_BYTES:] != _GUARD).any():
                raise EmulationError(f"{self.name}: the kernel wrote outside output '{name}'")
        del keep
        return [_from_numpy(o, d) for o, d in zip(outputs, output_dtypes)]


def metal_kernel(name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, compile_options=None):
    """Drop-in for ``mx.fast.metal_kernel`` that runs on the CPU emulator."""
    return EmulatedKernel(name, input_names, output_names, source, header,
                          ensure_row_contiguous, atomic_outputs, compile_options)


__all__ = [
    "EmulatedKernel", "EmulationError", "compile_source", "metal_kernel",
    "rewrite_threadgroup", "write_signature", "cache_dir",
]
