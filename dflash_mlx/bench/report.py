"""The bench report: its JSON schema, the machine it ran on, reading and
writing it."""

import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Optional

from ..errors import DFlashError
from .schedule import BASELINE, DFLASH, arms

SCHEMA = "dflash-mlx-bench"
SCHEMA_VERSION = 1


def machine_info() -> dict:
    """Platform, Python, MLX (version, backend, device) and BLAS on Linux."""
    import mlx.core as mx

    from importlib import metadata

    def version(dist: str) -> Optional[str]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    metal = cuda = False
    try:
        metal = bool(mx.metal.is_available())
    except Exception:
        pass
    try:
        cuda = bool(mx.cuda.is_available())
    except Exception:
        pass
    info = {
        "platform": platform.platform(),
        "system": platform.system(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "dflash_mlx": version("dflash-mlx"),
        "backend": "metal" if metal else ("cuda" if cuda else "cpu"),
        "default_device": str(mx.default_device()),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "reference_kernels_forced": os.environ.get("DFLASH_MLX_REFERENCE"),
    }
    if metal:
        try:
            dev = mx.metal.device_info()
            info["metal"] = {k: dev.get(k) for k in ("architecture", "memory_size", "max_recommended_working_set_size")}
        except Exception:
            info["metal"] = {}
    if platform.system() == "Linux":
        from ..doctor import blas_report  # /proc/self/maps: reference BLAS or OpenBLAS

        info["blas"], info["blas_advice"] = blas_report()
    return info


REQUIRED = {
    "top": {"schema": str, "schema_version": int, "created": str, "machine": dict, "config": dict,
            "prompts": list, "runs": list, "pairs": list, "summary": dict},
    "config": {"model": str, "draft": str, "max_tokens": int, "block_sizes": list, "repeat": int,
               "temperature": (int, float), "dtype": str, "chat_template": bool, "prompts": str},
    "machine": {"platform": str, "mlx": str, "backend": str, "python": str},
    "run": {"step": int, "prompt_id": str, "category": str, "repeat": int, "arm": str,
            "prompt_tokens": int, "tokens": list, "generated": int, "prefill_s": float,
            "decode_s": float, "wall_s": float, "peak_memory_gb": float},
    "dflash_run": {"block_size": (int, str), "cycles": int, "accepted": list},
    "pair": {"prompt_id": str, "category": str, "repeat": int, "block_size": (int, str),
             "baseline_step": int, "dflash_step": int},
    "side": {"runs": int, "wall_s": float, "decode_tokens": int},
    "dflash_side": {"cycles": int, "accepted_histogram": list, "position_acceptance": list,
                    "by_category": dict, "compared": int, "divergences": list},
}


def validate_report(report: dict) -> None:
    """Raise DFlashError if ``report`` is not a bench report of this schema.
    Tree arms (config ``tree_budgets`` at ``tree_block_size``) are optional:
    reports written before them validate as they are."""

    def need(obj: dict, kind: str, where: str) -> None:
        if not isinstance(obj, dict):
            raise DFlashError(f"{where}: expected an object")
        for key, types in REQUIRED[kind].items():
            if key not in obj:
                raise DFlashError(f"{where}: missing '{key}'")
            ok = isinstance(obj[key], types) and not (types is int and isinstance(obj[key], bool))
            if types is float:
                ok = isinstance(obj[key], (int, float)) and not isinstance(obj[key], bool)
            if not ok:
                raise DFlashError(f"{where}: '{key}' has type {type(obj[key]).__name__}")

    need(report, "top", "report")
    if report["schema"] != SCHEMA or report["schema_version"] != SCHEMA_VERSION:
        raise DFlashError(f"report schema is {report['schema']} v{report['schema_version']}, "
                          f"expected {SCHEMA} v{SCHEMA_VERSION}")
    need(report["config"], "config", "config")
    need(report["machine"], "machine", "machine")
    cfg = report["config"]
    budgets, tree_block = cfg.get("tree_budgets") or [], cfg.get("tree_block_size")
    if not isinstance(budgets, list) or (budgets and not (_counts(budgets, 1) and _counts([tree_block], 2))):
        raise DFlashError("config: tree_budgets must be integers >= 1 and tree_block_size an integer >= 2")
    for i, run in enumerate(report["runs"]):
        need(run, "run", f"runs[{i}]")
        if run["arm"] == DFLASH:
            need(run, "dflash_run", f"runs[{i}]")
            if run.get("tree_budget") is not None and not _counts([run["tree_budget"]], 1):
                raise DFlashError(f"runs[{i}]: tree_budget must be an integer >= 1")
            if len(run["accepted"]) != run["cycles"]:
                raise DFlashError(f"runs[{i}]: {run['cycles']} cycles but {len(run['accepted'])} accepted counts")
        elif run["arm"] != BASELINE:
            raise DFlashError(f"runs[{i}]: unknown arm '{run['arm']}'")
    for i, pair in enumerate(report["pairs"]):
        need(pair, "pair", f"pairs[{i}]")
    need(report["summary"].get("baseline"), "side", "summary.baseline")
    for arm in arms(cfg["block_sizes"], budgets, tree_block, cfg.get("confidence_schedules")):
        side = report["summary"].get("dflash", {}).get(arm.key)
        need(side, "side", f"summary.dflash.{arm.key}")
        need(side, "dflash_side", f"summary.dflash.{arm.key}")
        if arm.block_size != "auto" and len(side["accepted_histogram"]) != arm.block_size:
            raise DFlashError(f"summary.dflash.{arm.key}: histogram has {len(side['accepted_histogram'])} bins")


def _counts(values: list, low: int) -> bool:
    """Every value an integer (not a bool) of at least ``low``."""
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in values)


def _jsonable(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def check_output_file(path: str | Path, flag: str) -> Path:
    """Raise a one-line DFlashError unless a file can be written at ``path``: it is
    not a directory and its nearest existing parent is a writable directory.
    Checked before a run, so that its figures have somewhere to go."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise DFlashError(f"{flag} '{path}' is a directory; give a file name")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise DFlashError(f"{flag} '{path}' cannot be written: '{parent}' is not a writable directory")
    return path


def write_json(report: dict, path: str | Path) -> None:
    """Write atomically: a temporary file beside ``path``, renamed over it."""
    path = Path(path).expanduser()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(_jsonable(report), indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise DFlashError(f"cannot write '{path}': {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def read_report(path: str | Path) -> dict:
    """A bench report from a JSON file, checked against the schema."""
    try:
        report = json.loads(Path(path).read_text())
    except OSError as e:
        raise DFlashError(f"cannot read '{path}': {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"'{path}' is not valid JSON ({getattr(e, 'msg', e)})") from None
    validate_report(report)
    return report


def make_report(result: dict, config: dict, machine: dict) -> dict:
    """The report of a run: ``run_bench``'s result with the schema, config and machine."""
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["dflash-mlx", *sys.argv[1:]]) if sys.argv else None,
            "machine": machine, "config": config, **result}

