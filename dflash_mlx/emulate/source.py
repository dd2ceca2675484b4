"""A kernel body as the C++ translation unit the harness compiles: the kernel
signature exactly as MLX writes it, template arguments, and the rewrite of
threadgroup array declarations."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np


# mlx/fast.cpp: inputs smaller than this go in the constant address space
MAX_CONSTANT_ARRAY_SIZE = 8

# mlx/fast.cpp `metal_kernel`: attributes added when their name occurs in the source
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]

# MLX get_type_string; numpy storage for each dtype (bfloat16 travels as uint16)
_TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
    mx.bool_: ("bool", np.bool_),
}


class EmulationError(RuntimeError):
    """The kernel failed to compile or misbehaved while running (deadlock,
    barrier not reached by all threads, write out of bounds ...)."""


def type_string(dtype: mx.Dtype) -> str:
    if dtype not in _TYPES:
        raise EmulationError(f"unsupported dtype {dtype}")
    return _TYPES[dtype][0]


def _template_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, mx.Dtype):
        return type_string(value)
    raise EmulationError(f"template arguments are int, bool or mx.Dtype, got {value!r}")


def _template_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return "typename"


_TG_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\]\[;]+\]\s*)*);"
)


def rewrite_threadgroup(source: str) -> str:
    """``threadgroup T name[N];`` -> a reference into per-threadgroup memory."""
    counter = iter(range(1, 1 << 30))

    def sub(m: re.Match) -> str:
        dims = re.sub(r"\s+", "", m.group("dims"))
        return f"auto& {m.group('name')} = ::emu::tg_alloc<{m.group('type').strip()}{dims}>({next(counter)});"

    return _TG_DECL.sub(sub, source)


@dataclass(frozen=True)
class _Param:
    decl: str  # the declaration in the signature
    cast: str  # how the launcher passes it from the void* table


def write_signature(
    func_name: str,
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[mx.array],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, Any]],
    atomic_outputs: bool,
) -> tuple[str, list[_Param], list[str], list[tuple[int, str]]]:
    """The kernel function as MLX's ``write_signature`` builds it.

    Returns (text, buffer parameters in order, attribute names in order,
    buffer table layout: (input index or -1-output index, role)).
    """
    params: list[_Param] = []
    layout: list[tuple[int, str]] = []
    for i, (name, arr) in enumerate(zip(input_names, inputs)):
        t = type_string(arr.dtype)
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        if arr.ndim == 0:
            params.append(_Param(f"const {location} {t}& {name}", f"*(const {t}*)"))
        else:
            params.append(_Param(f"const {location} {t}* {name}", f"(const {t}*)"))
        layout.append((i, "data"))
        if arr.ndim > 0:
            if f"{name}_shape" in source:
                params.append(_Param(f"const constant int* {name}_shape", "(const int*)"))
                layout.append((i, "shape"))
            if f"{name}_strides" in source:
                params.append(_Param(f"const constant int64_t* {name}_strides", "(const int64_t*)"))
                layout.append((i, "strides"))
            if f"{name}_ndim" in source:
                params.append(_Param(f"const constant int& {name}_ndim", "*(const int*)"))
                layout.append((i, "ndim"))
    for j, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        t = type_string(dtype)
        t = f"atomic<{t}>" if atomic_outputs else t
        params.append(_Param(f"device {t}* {name}", f"({t}*)"))
        layout.append((-1 - j, "data"))
    attributes = [(a, t) for a, t in ATTRIBUTES if a in source]
    lines = []
    if template:
        lines.append("template <" + ", ".join(f"{_template_kind(v)} {n}" for n, v in template) + ">")
    lines.append(f"[[kernel]] void {func_name}(")
    decls = [f"  {p.decl} [[buffer({k})]]" for k, p in enumerate(params)]
    decls += [f"  {t} {a} [[{a}]]" for a, t in attributes]
    lines.append(",\n".join(decls) + ") {")
    return "\n".join(lines), params, [a for a, _ in attributes], layout
