"""Safetensors shards written one at a time, into a directory that
``dflash_mlx.atomic.staged_output`` renames into place only on success."""

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx

SHARD_BYTES = 1 << 30


def write_shards(
    groups: Iterable[dict[str, mx.array]],
    out: Path,
    shard_bytes: int = SHARD_BYTES,
    log: Callable[[str], None] = lambda _: None,
) -> None:
    """Evaluate each group of tensors (one source tensor's outputs) and write them
    in shards of about ``shard_bytes``, so only one shard is held in memory.

    Files are named as mlx-lm names them, with ``model.safetensors.index.json``.
    """
    out.mkdir(parents=True, exist_ok=True)
    files: list[list[str]] = []  # tensor names per shard
    weight_map, total, shard, size = {}, 0, {}, 0

    def flush():
        name = f"part-{len(files) + 1:05d}.safetensors"
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        files.append(list(shard))
        log(f"wrote shard {len(files)} ({size / 2**20:.0f} MiB, {len(shard)} tensors)")
        shard.clear()
        mx.clear_cache()

    for group in groups:
        mx.eval(list(group.values()))
        nbytes = sum(v.nbytes for v in group.values())
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard.update(group)
        size += nbytes
        total += nbytes
    if shard:
        flush()
    for i, names in enumerate(files):
        final = (
            "model.safetensors"
            if len(files) == 1
            else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        )
        os.rename(out / f"part-{i + 1:05d}.safetensors", out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
