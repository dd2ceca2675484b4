"""DFlash over a tensor-parallel target: two local processes on MLX's ring
backend over 127.0.0.1 (distributed_worker.py is each rank)."""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from checkpoints import write_target
from mlx_lm import convert as mlx_lm_convert

from dflash_mlx import DFlashError, generate, load, load_draft
from dflash_mlx import distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
# (mode, family): tensor parallel where mlx-lm's model has shard(), pipeline where it has pipeline();
# qwen3_5_untied: the tensor-parallel head is split over the vocabulary too
CASES = [("tensor", f) for f in ("llama", "qwen3", "qwen3_5", "qwen3_5_untied")] + [
    ("pipeline", f) for f in ("qwen3_5", "qwen3_moe")
]
# the other families mlx-lm can shard, in a launch of their own under -m slow
# (and 4-bit targets: q4, converted by mlx-lm), in a launch of their own under -m slow
MORE_CASES = [("tensor-more", f) for f in ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "llama_q4", "qwen3_5_q4")] + [
    ("pipeline-more", f) for f in ("qwen3_5_moe", "qwen3_5_q4")
]
ADAPTIVE_FAMILY = "qwen3_5"  # the adaptive block's runs, in both modes (its agreement knows no family)
NO_PIPELINE = ("llama", "qwen3")  # mlx-lm's classes have no pipeline(): refused with one line
PROMPT = "the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 24
INDEX = "model.safetensors.index.json"
EOS = 2  # the tiny checkpoints' eos_token_id
STALL_S = 180  # a launch whose ranks print nothing for this long is stuck
CAP_S = 1800  # the most a launch may take in all, however busy the machine
SEEDED = {"block_size": 4, "temperature": 1.0, "seed": 7, "logit_bias": {EOS: -1e9}}
TREE = {"block_size": 4, "tree_budget": 6}
# DDTree: attention only, and GatedDeltaNet (tensor); GatedDeltaNet and MoE stages (pipeline)
TREE_CASES = [("tensor", "llama"), ("tensor", "qwen3_5"), ("pipeline", "qwen3_5"), ("pipeline", "qwen3_moe")]


def free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free on 127.0.0.1, below the kernel's ephemeral
    range (32768 and up), where the ranks' own outgoing connections cannot take it."""
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(20000, 32768 - n)
        try:
            sockets = [socket.create_server(("127.0.0.1", start + i)) for i in range(n)]
        except OSError:
            continue
        for s in sockets:
            s.close()
        return start
    raise RuntimeError("no free ports on 127.0.0.1")


def wait_while_writing(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait for ``procs`` for as long as one of them keeps writing to its log (the
    worker prints a line per response): a busy machine slows a launch without failing
    it, while one that stalls STALL_S, or outlives CAP_S, is killed. Once the first
    (rank 0) has exited, the others get 15 s more."""
    start = last = time.monotonic()
    sizes = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if (grown := [log.stat().st_size for log in logs]) != sizes:
            sizes, last = grown, now
        first_done = procs[0].poll() is not None and now - last > 15
        if first_done or now - last > STALL_S or now - start > CAP_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()


def launch(tmp_path: Path, spec: dict, size: int = 2) -> list[tuple[int, str]]:
    """Run the worker as ranks 0..size-1 of a ring over 127.0.0.1, set up as
    mlx.launch sets it up (MLX_RANK, MLX_HOSTFILE); (returncode, stderr) per rank."""
    hostfile = tmp_path / "hosts.json"
    start = free_ports(size)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{start + rank}"] for rank in range(size)]))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    logs = [(tmp_path / f"rank{rank}.out", tmp_path / f"rank{rank}.err") for rank in range(size)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(spec_path), str(tmp_path)],
            env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
            stdout=open(out, "w"), stderr=open(err, "w"), cwd=WORKER.parent,
        )
        for rank, (out, err) in enumerate(logs)
    ]
    wait_while_writing(procs, [log for pair in logs for log in pair])
    return [(p.returncode, err.read_text()) for p, (_, err) in zip(procs, logs)]


@pytest.fixture(scope="module")
def pairs(target_dirs, draft_dir, tmp_path_factory):
    """family -> (target dir, draft dir). qwen3_5's target is one file with no
    model.safetensors.index.json, as small checkpoints ship (pipeline loading needs one)."""
    untied = tmp_path_factory.mktemp("target-qwen3_5-untied")
    write_target(untied, "qwen3_5", tie_word_embeddings=False)
    single_file = tmp_path_factory.mktemp("target-qwen3_5-single-file") / "model"
    shutil.copytree(target_dirs["qwen3_5"], single_file, ignore=shutil.ignore_patterns(INDEX))
    dirs = {**target_dirs, "qwen3_5_untied": untied, "qwen3_5": single_file}
    families = {f for _, f in CASES + MORE_CASES} | set(NO_PIPELINE)
    for family in [f for f in families if f.endswith("_q4")]:
        dirs[family] = tmp_path_factory.mktemp(f"target-{family}") / "model"
        mlx_lm_convert(str(dirs[family.removesuffix("_q4")]), mlx_path=str(dirs[family]), quantize=True,
                       q_group_size=32, q_bits=4)  # 32: a rank's half of a 64-wide input
    return {f: (str(dirs[f]), str(draft_dir(f.removesuffix("_untied").removesuffix("_q4")))) for f in families}


def curve(target_s: list[float]) -> dict:
    sizes = [1, 2, 4, 8, 12, 16]
    return {"sizes": sizes, "target_s": target_s, "draft_s": [0.0] + [0.001] * 5}


# rank 0's curve makes a plain step (b = 1) far dearer than any block; rank 1's turns speculation off
CURVES = [curve([1.0, 0.01, 0.01, 0.01, 0.01, 0.01]), curve([0.01, 1.0, 1.0, 1.0, 1.0, 1.0])]


@pytest.fixture(scope="module")
def launched(pairs, tmp_path_factory):
    """launch ("tensor", "pipeline", or either + "-more") -> what each of the two
    ranks decoded, per run (one launch each, on the first test that asks)."""
    done = {}

    def get(name: str) -> list[dict]:
        mode = name.removesuffix("-more")
        if name not in done:
            runs = []
            for family in sorted({f for m, f in CASES + MORE_CASES if m == name}):
                target, draft = pairs[family]
                common = {"target": target, "draft": draft, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
                runs += [
                    {"name": f"{family}-greedy", **common, "options": {"block_size": 4}},
                    {"name": f"{family}-sampled", **common,  # no seed: rank 0 draws it; EOS barred: full length
                     "options": {"block_size": 4, "temperature": 1.0, "logit_bias": {EOS: -1e9}}},
                    {"name": f"{family}-seeded", **common, "options": SEEDED},
                ]
                if (name, family) in TREE_CASES:
                    runs += [{"name": f"{family}-tree", **common, "options": TREE},
                             {"name": f"{family}-tree-seeded", **common, "options": {**SEEDED, **TREE}}]
                if family == ADAPTIVE_FAMILY:
                    runs += [
                        {"name": f"{family}-auto", **common, "options": {"block_size": "auto"},
                         "curve_per_rank": CURVES},
                        {"name": f"{family}-auto-off", **common, "options": {"block_size": "auto"},
                         "curve_per_rank": CURVES[::-1]},
                        # no curve: measured by both ranks together and cached by rank 0, then read back
                        {"name": f"{family}-auto-measured", **common, "options": {"block_size": "auto"}},
                        {"name": f"{family}-auto-cached", **common, "options": {"block_size": "auto"}},
                    ]
            refused = [pairs[f][0] for f in NO_PIPELINE] if name == "pipeline" else []
            tmp = tmp_path_factory.mktemp(f"two-ranks-{name}")
            outcome = launch(tmp, {"mode": mode, "runs": runs, "refused": refused})
            assert [rc for rc, _ in outcome] == [0, 0], [err[-2000:] for _, err in outcome]
            done[name] = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
        return done[name]

    return get


@pytest.mark.parametrize("mode,family", CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in MORE_CASES])
def test_greedy_equals_single_process_and_mlx_lm_sharded(launched, pairs, mode, family):
    ranks = launched(mode)
    target, draft = pairs[family]
    model, tokenizer = load(target)
    single = generate(model, load_draft(draft), tokenizer, ranks[0][f"{family}-greedy"]["prompt"],
                      block_size=4, max_tokens=MAX_TOKENS)
    for rank in ranks:
        run = rank[f"{family}-greedy"]
        assert len(run["tokens"]) > 4
        assert run["tokens"] == single.tokens  # the unsharded loop
        assert run["tokens"] == run["mlx_lm"]  # mlx-lm's own decoding of the same sharded model
        assert run["blocks"][1:] == single.block_sizes and 4 in single.block_sizes  # 4, or the tokens left


@pytest.mark.parametrize("mode,family", CASES)
def test_sampled_identical_across_ranks(launched, mode, family):
    ranks = launched(mode)
    a, b = (rank[f"{family}-sampled"]["tokens"] for rank in ranks)
    assert len(a) == MAX_TOKENS
    assert a == b
    assert a != ranks[0][f"{family}-greedy"]["tokens"]  # it did sample: no seed was given, rank 0 drew one


@pytest.mark.parametrize("mode,family", CASES)
def test_sampled_with_a_seed_draws_as_one_process_does(launched, pairs, mode, family):
    """The same acceptance rule on the same logits with the same uniforms: a seeded
    sampled run on the sharded target gives the single-process run's tokens, so the
    single-process distribution tests (tests/test_sampling.py) hold for it too."""
    target, draft = pairs[family]
    model, tokenizer = load(target)
    ranks = launched(mode)
    single = generate(model, load_draft(draft), tokenizer, ranks[0][f"{family}-seeded"]["prompt"],
                      max_tokens=MAX_TOKENS, **SEEDED)
    assert single.tokens != ranks[0][f"{family}-greedy"]["tokens"]  # it sampled
    for rank in ranks:
        assert rank[f"{family}-seeded"]["tokens"] == single.tokens


@pytest.mark.parametrize("mode,family", TREE_CASES)
def test_ddtree_on_a_sharded_target_equals_one_process(launched, pairs, mode, family):
    """A DDTree verified on the sharded target: greedy, the single-process tree's
    tokens and mlx-lm's sharded greedy; sampled with a seed, the single-process draws."""
    target, draft = pairs[family]
    model, tokenizer = load(target)
    ranks = launched(mode)
    prompt = ranks[0][f"{family}-tree"]["prompt"]
    greedy = generate(model, load_draft(draft), tokenizer, prompt, max_tokens=MAX_TOKENS, **TREE)
    sampled = generate(model, load_draft(draft), tokenizer, prompt, max_tokens=MAX_TOKENS, **{**SEEDED, **TREE})
    for rank in ranks:
        assert rank[f"{family}-tree"]["tokens"] == greedy.tokens == rank[f"{family}-tree"]["mlx_lm"]
        assert rank[f"{family}-tree-seeded"]["tokens"] == sampled.tokens


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_adaptive_block_follows_rank_0s_curve(launched, mode, family=ADAPTIVE_FAMILY):
    a, b = (rank[f"{family}-auto"] for rank in launched(mode))
    assert a == b
    assert 1 not in a["blocks"][1:-1]  # rank 1's own curve would have turned speculation off (the last: 1 token left)
    assert a["tokens"] == launched(mode)[0][f"{family}-greedy"]["tokens"]


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_plain_steps_when_rank_0s_curve_turns_speculation_off(launched, mode, family=ADAPTIVE_FAMILY):
    a, b = (rank[f"{family}-auto-off"] for rank in launched(mode))
    assert a == b
    blocks = a["blocks"][1:]  # plain steps (each queued before the host waits for the one before), and probes
    assert blocks.count(1) > len(blocks) / 2
    assert a["tokens"] == launched(mode)[0][f"{family}-greedy"]["tokens"]


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_cost_curve_measured_together_then_cached(launched, mode, family=ADAPTIVE_FAMILY):
    greedy = launched(mode)[0][f"{family}-greedy"]["tokens"]
    for run in ("auto-measured", "auto-cached"):
        a, b = (rank[f"{family}-{run}"] for rank in launched(mode))
        assert a == b  # the same blocks, cycle by cycle, and the same tokens
        assert a["tokens"] == greedy
    cached = [json.loads(p.read_text()) for p in Path(os.environ["DFLASH_MLX_CACHE_DIR"]).rglob("*.json")]
    assert any(c.get("key", {}).get("distributed") == f"{mode} x2" for c in cached)


def test_pipeline_loads_a_single_file_checkpoint(launched, pairs):
    """qwen3_5's runs above load a target without an index; its folder stays as it was."""
    assert launched("pipeline")[0]["qwen3_5-greedy"]["tokens"]
    assert sorted(p.name for p in Path(pairs["qwen3_5"][0]).iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_pipeline_refuses_models_without_stages(launched, pairs):
    for rank in launched("pipeline"):
        for family in NO_PIPELINE:
            error = rank["refused"][pairs[family][0]]
            assert "with pipeline parallelism over 2 ranks" in error and "does not support pipelining" in error
            assert "\n" not in error


@pytest.mark.parametrize("how", ["exit", pytest.param("hang", marks=pytest.mark.slow)])
def test_a_lost_rank_ends_the_other_with_one_line(pairs, tmp_path, how):
    target, draft = pairs["qwen3"]
    run = {"name": "run", "target": target, "draft": draft, "prompt": PROMPT, "max_tokens": 200,
           "options": {"block_size": 4}}
    # rank 1's watchdog waits longer, so that rank 0's is the one that ends a hang
    outcome = launch(tmp_path, {"runs": [run], "fail": {"rank": 1, "after": 2, "how": how}, "timeouts": [5, 60]})
    (rc0, err0), (rc1, _) = outcome
    assert rc1 == 3 if how == "exit" else rc1 != 0
    assert rc0 == 1
    last = err0.strip().splitlines()[-1]
    if how == "exit":
        assert last.startswith("error: rank 0: the distributed group lost a rank ("), err0
    else:
        assert last.startswith("error: rank 0: no progress from the distributed group in 5 s"), err0


def test_alone_or_unknown_mode_is_one_clear_error():
    with pytest.raises(DFlashError, match="needs two or more processes started by mlx.launch"):
        distributed.init("tensor")
    with pytest.raises(DFlashError, match="must be one of tensor, pipeline"):
        distributed.init("data")
    assert distributed.talks(None) and distributed.talks(mx.distributed.init())


def test_watchdog_ends_a_stuck_rank_with_one_line():
    code = "import time\nfrom dflash_mlx.distributed import Watchdog\nwith Watchdog(0.5, 1):\n    time.sleep(30)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: rank 1: no progress from the distributed group in 0.5 s "
        "(a rank stopped or its machine is unreachable); exiting"
    ]


def mlx_launch(tmp_path: Path, *command: str) -> tuple[str, str]:
    """``mlx.launch --backend ring -n 2 -- command`` on 127.0.0.1 (bounded as
    ``launch`` is); its stdout and stderr, each rank's merged."""
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    mlx_launch = str(Path(sys.executable).with_name("mlx.launch"))
    proc = subprocess.Popen([mlx_launch, "--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2)),
                             "--", *command], stdout=open(out, "w"), stderr=open(err, "w"), cwd=tmp_path)
    wait_while_writing([proc], [out, err])
    return out.read_text(), err.read_text()


def generate_command(target: str, draft: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "dflash_mlx", "generate", "--model", target, "--draft", draft, "-p", PROMPT,
            "--no-chat-template", *options]


def test_cli_under_mlx_launch_only_rank_0_talks(pairs, tmp_path):
    target, draft = pairs["qwen3_5"]
    model, tokenizer = load(target)
    single = generate(model, load_draft(draft), tokenizer, PROMPT, block_size=4, max_tokens=16)
    out, err = mlx_launch(tmp_path, *generate_command(target, draft, "-b", "4", "-n", "16", "--distributed", "tensor"))
    assert "exited with code" not in err, err  # mlx.launch itself exits 0 whatever the ranks do
    assert out == single.text + "\n", err  # the text once: rank 1 printed nothing
    (stats,) = [line for line in err.splitlines() if line.startswith("prompt:")]  # rank 0's only
    cycles = len(single.acceptance_lengths)
    assert f"{cycles} cycles, tau {single.mean_acceptance:.2f} tokens/cycle" in stats


@pytest.mark.parametrize("options,error", [
    (("--distributed", "pipeline"), "with pipeline parallelism over 2 ranks"),  # once the ranks are joined
    (("--distributed", "tensor", "--kv-bits", "4"), "--kv-bits is not supported with --distributed"),  # before
])
def test_an_error_every_rank_hits_is_printed_once(pairs, tmp_path, options, error):
    target, draft = pairs["llama"]  # llama: mlx-lm's class has no pipeline()
    _, err = mlx_launch(tmp_path, *generate_command(target, draft, *options))
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        line for line in err.splitlines() if error in line], err
    assert len([line for line in err.splitlines() if error in line]) == 1, err
    assert "Traceback" not in err


# rank 1 of mlx.launch SIGKILLs itself once rank 0 waits for it to join (bound: rank 1 never
# starts joining), or once they are joined (rank 1 running the command line too)
KILL_RANK_1 = """
import json, os, runpy, signal, sys, threading, time
port = int(json.load(open(os.environ["MLX_HOSTFILE"]))[0][0].split(":")[1])
state = {"bound": "0A", "joined": "01"}[sys.argv[1]]  # LISTEN, ESTABLISHED in /proc/net/tcp

def kill_when_there():
    while not any(f":{port:04X} " in line and line.split()[3] == state for line in open("/proc/net/tcp")):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)

if os.environ["MLX_RANK"] == "1":
    if state == "0A":
        kill_when_there()
    threading.Thread(target=kill_when_there, daemon=True).start()
sys.argv = ["dflash-mlx", *sys.argv[2:]]
runpy.run_module("dflash_mlx", run_name="__main__")
"""


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the ranks' sockets from /proc/net/tcp")
@pytest.mark.parametrize("when", ["bound", "joined"])
def test_a_rank_killed_before_the_first_token_ends_the_other_with_one_line(pairs, tmp_path, when):
    """mlx.launch ends rank 0 with SIGTERM once rank 1 is killed; rank 0 may be waiting
    inside MLX for it then (bound: to join; joined: loading), and must still say why."""
    target, draft = pairs["qwen3_5"]
    _, err = mlx_launch(tmp_path, sys.executable, "-c", KILL_RANK_1, when,
                        *generate_command(target, draft, "-b", "4", "-n", "16", "--distributed", "tensor")[3:])
    assert "Node with rank 1 exited with code -9" in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: the distributed group lost a rank"), err


def test_cli_rank_without_distributed_is_refused(pairs):
    target, draft = pairs["qwen3"]
    done = subprocess.run(generate_command(target, draft), capture_output=True, text=True, timeout=CAP_S,
                          env={**os.environ, "MLX_RANK": "0"})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: this process is a rank started by mlx.launch; pass --distributed tensor (or pipeline) "
        "so the ranks share one target"
    ]


def test_unsupported_options_are_one_clear_error():
    with pytest.raises(DFlashError, match="^--draft-vocab is not supported with --distributed; drop it"):
        next(distributed.stream_generate(None, None, None, "prompt", mx.distributed.init(), draft_vocab=64))
