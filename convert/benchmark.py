"""Convert a synthetic draft of the Qwen3.5-9B draft's size and report memory and time.

    python -m dflash_mlx.convert.benchmark [--workdir DIR]

Random bf16 weights in the published shapes are written to a temporary
directory; each conversion (bf16, 8-bit, 4-bit, mixed_4_8) then runs as
``python -m dflash_mlx convert`` in a fresh process, whose peak RSS comes from
``os.wait4``. Every big allocation happens in a child, since Linux counts the
parent's RSS at fork time in a child's peak. Not a test.

Shapes of z-lab/Qwen3.5-9B-DFlash (config.json as quoted in hipfire's
``parses_qwen35_9b_dflash_config`` test, and the guglxni/Qwen3.5-9B-abliterated-DFlash
model card): 5 layers, hidden 4096, 32 heads / 8 KV heads of 128,
intermediate 12288, 32 target layers tapped at [1, 8, 15, 22, 29]
(fc 4096 x 20480), vocab 248320, mask token 248070, block 16.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from dflash_mlx.draft import DraftConfig

from .checkpoint import expected_shapes

QWEN35_9B_DRAFT = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 248320,
    "rms_norm_eps": 1e-6,
    "num_target_layers": 32,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "dflash_config": {"block_size": 16, "mask_token_id": 248070, "target_layer_ids": [1, 8, 15, 22, 29]},
    "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
}
RUNS = {
    "bf16": [],
    "8-bit": ["--q-bits", "8"],
    "4-bit": ["--q-bits", "4"],
    "mixed_4_8": ["--recipe", "mixed_4_8"],
}


def write_synthetic(path: str) -> None:
    """Random bf16 weights of the published shapes, in the z-lab layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(DraftConfig.from_dict(QWEN35_9B_DRAFT))
    weights = {
        name: (mx.random.normal(shape) * 0.02 if len(shape) == 2 else mx.ones(shape)).astype(mx.bfloat16)
        for name, shape in shapes.items()
    }
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(QWEN35_9B_DRAFT, indent=2))


def measured(command: list[str]) -> tuple[float, float]:
    """Run ``command``; return (wall seconds, peak RSS bytes) of that process alone."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(command)}\n{child.stderr.read().decode()}")
    return wall, usage.ru_maxrss * 1024.0  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = Path(tmp) / "Qwen3.5-9B-DFlash-synthetic"
        print("writing the synthetic checkpoint ...", file=sys.stderr)
        write = f"from dflash_mlx.convert.benchmark import write_synthetic; write_synthetic({str(src)!r})"
        measured([sys.executable, "-c", write])
        size = (src / "model.safetensors").stat().st_size
        _, base = measured([sys.executable, "-c", "import dflash_mlx.convert"])
        gib = 2.0**30
        print(f"checkpoint: {size / gib:.2f} GiB bf16 ({size:,} bytes); "
              f"interpreter + imports alone: {base / gib:.2f} GiB RSS")
        print(f"{'run':<10} {'wall s':>7} {'peak RSS GiB':>13} {'RSS/ckpt':>9} "
              f"{'on disk GiB':>12} {'disk/ckpt':>10}")
        for name, extra in RUNS.items():
            out = Path(tmp) / name
            wall, rss = measured([sys.executable, "-m", "dflash_mlx", "convert", str(src),
                                  "--out", str(out), *extra])
            disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            print(f"{name:<10} {wall:7.1f} {rss / gib:13.2f} {rss / size:9.2f} "
                  f"{disk / gib:12.3f} {disk / size:10.3f}", flush=True)


if __name__ == "__main__":
    main()
