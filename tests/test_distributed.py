"""DFlash over a tensor-parallel target: two local processes on MLX's ring
backend over 127.0.0.1 (distributed_worker.py is each rank)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from checkpoints import write_target

from dflash_mlx import DFlashError, generate, load, load_draft
from dflash_mlx import distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
FAMILIES = ["llama", "qwen3", "qwen3_5", "qwen3_5_untied"]  # untied: the head is split over the vocabulary too
PROMPT = "the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 24
LAUNCH_TIMEOUT_S = 120


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(tmp_path: Path, spec: dict, size: int = 2) -> list[subprocess.CompletedProcess]:
    """Run the worker as ranks 0..size-1 of a ring over 127.0.0.1, set up as
    mlx.launch sets it up (MLX_RANK, MLX_HOSTFILE); (returncode, stderr) per rank."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(size)]))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(spec_path), str(tmp_path)],
            env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=WORKER.parent,
        )
        for rank in range(size)
    ]
    outcome = []
    for rank, p in enumerate(procs):  # rank 0 gets the whole time; a rank still running after it is killed
        try:
            p.wait(timeout=LAUNCH_TIMEOUT_S if rank == 0 else 15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        outcome.append((p.returncode, p.stderr.read()))
    return outcome


@pytest.fixture(scope="module")
def pairs(target_dirs, draft_dir, tmp_path_factory):
    """family -> (target dir, draft dir)."""
    untied = tmp_path_factory.mktemp("target-qwen3_5-untied")
    write_target(untied, "qwen3_5", tie_word_embeddings=False)
    dirs = {**target_dirs, "qwen3_5_untied": untied}
    return {f: (str(dirs[f]), str(draft_dir(f.removesuffix("_untied")))) for f in FAMILIES}


def curve(target_s: list[float]) -> dict:
    sizes = [1, 2, 4, 8, 12, 16]
    return {"sizes": sizes, "target_s": target_s, "draft_s": [0.0] + [0.001] * 5}


# rank 0's curve makes a plain step (b = 1) far dearer than any block; rank 1's turns speculation off
CURVES = [curve([1.0, 0.01, 0.01, 0.01, 0.01, 0.01]), curve([0.01, 1.0, 1.0, 1.0, 1.0, 1.0])]


@pytest.fixture(scope="module")
def ranks(pairs, tmp_path_factory):
    """What each of the two ranks decoded, per run."""
    runs = []
    for family, (target, draft) in pairs.items():
        common = {"target": target, "draft": draft, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        runs += [
            {"name": f"{family}-greedy", **common, "options": {"block_size": 4}},
            {"name": f"{family}-sampled", **common, "options": {"block_size": 4, "temperature": 1.0}},
            {"name": f"{family}-auto", **common, "options": {"block_size": "auto"}, "curve_per_rank": CURVES},
        ]
    tmp = tmp_path_factory.mktemp("two-ranks")
    outcome = launch(tmp, {"runs": runs})
    assert [rc for rc, _ in outcome] == [0, 0], [err[-2000:] for _, err in outcome]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_single_process_and_mlx_lm_sharded(ranks, pairs, family):
    target, draft = pairs[family]
    model, tokenizer = load(target)
    single = generate(model, load_draft(draft), tokenizer, ranks[0][f"{family}-greedy"]["prompt"],
                      block_size=4, max_tokens=MAX_TOKENS)
    for rank in ranks:
        run = rank[f"{family}-greedy"]
        assert len(run["tokens"]) > 4
        assert run["tokens"] == single.tokens  # the unsharded loop
        assert run["tokens"] == run["mlx_lm"]  # mlx-lm's own decoding of the same sharded model
        assert set(run["blocks"][1:]) == {4}


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_identical_across_ranks(ranks, family):
    a, b = (rank[f"{family}-sampled"]["tokens"] for rank in ranks)
    assert len(a) == MAX_TOKENS
    assert a == b
    assert a != ranks[0][f"{family}-greedy"]["tokens"]  # it did sample: no seed was given, rank 0 drew one


@pytest.mark.parametrize("family", FAMILIES)
def test_adaptive_block_follows_rank_0s_curve(ranks, family):
    a, b = (rank[f"{family}-auto"] for rank in ranks)
    assert a == b
    assert 1 not in a["blocks"][1:]  # rank 1's own curve would have turned speculation off
    assert a["tokens"] == ranks[0][f"{family}-greedy"]["tokens"]


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_lost_rank_ends_the_other_with_one_line(pairs, tmp_path, how):
    target, draft = pairs["qwen3"]
    run = {"name": "run", "target": target, "draft": draft, "prompt": PROMPT, "max_tokens": 200,
           "options": {"block_size": 4}}
    outcome = launch(tmp_path, {"runs": [run], "fail": {"rank": 1, "after": 2, "how": how}, "timeout": 5})
    (rc0, err0), (rc1, _) = outcome
    assert rc1 == 3 if how == "exit" else rc1 != 0
    assert rc0 == 1
    last = err0.strip().splitlines()[-1]
    if how == "exit":
        assert last.startswith("error: rank 0: the distributed group lost a rank ("), err0
    else:
        assert last.startswith("error: rank 0: no progress from the distributed group in 5 s"), err0


def test_alone_or_pipeline_is_one_clear_error():
    with pytest.raises(DFlashError, match="needs two or more processes started by mlx.launch"):
        distributed.init("tensor")
    with pytest.raises(DFlashError, match="pipeline is not supported"):
        distributed.init("pipeline")
    with pytest.raises(DFlashError, match="must be one of tensor, pipeline"):
        distributed.init("data")
    assert distributed.talks(None) and distributed.talks(mx.distributed.init())
