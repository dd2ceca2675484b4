"""dflash-mlx bench --distributed: a measured run on two ranks of MLX's ring
backend over 127.0.0.1 (set up as mlx.launch sets them up); only rank 0
prints and writes."""

import json
import os
import subprocess
import sys

from test_distributed import PROMPT, free_ports


def test_a_measured_bench_on_two_ranks_only_rank_0_talks(target_dirs, draft_dir, tmp_path):
    target, draft = target_dirs["qwen3_5"], draft_dir("qwen3_5", block_size=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "category": "test", "id": "p0"}) + "\n")
    start = free_ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{start + rank}"] for rank in range(2)]))
    command = [sys.executable, "-m", "dflash_mlx", "bench", "--model", str(target), "--draft", str(draft),
               "--prompts", str(prompts), "-n", "12", "-b", "4", "--no-chat-template", "--no-warmup",
               "--distributed", "tensor", "--json", "report.json"]  # relative: each rank in a folder of its own
    folders = [tmp_path / f"rank{rank}" for rank in range(2)]
    procs = []
    for rank, folder in enumerate(folders):
        folder.mkdir()
        procs.append(subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}))
    outcome = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outcome]
    (out0, err0), (out1, err1) = outcome
    assert "speedup" in out0 and "wrote report.json" in err0
    assert (out1, err1) == ("", "")  # rank 1 ran every arm with rank 0, silently
    assert not (folders[1] / "report.json").exists()
    report = json.loads((folders[0] / "report.json").read_text())
    assert report["config"]["distributed"] == "tensor x2"
    runs = {run["arm"]: run for run in report["runs"]}
    assert runs["dflash"]["tokens"] == runs["baseline"]["tokens"]  # greedy: the sharded mlx-lm's own tokens
    assert len(runs["dflash"]["tokens"]) > 4
