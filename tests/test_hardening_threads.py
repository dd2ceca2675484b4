"""Several threads generating on one loaded pair: a tree pass changes nothing
another thread sees, nor does a quantized target's verify pass, so every
generation equals what it gives alone (docs/threads.md)."""

import shutil
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx import generate, kernels, load_draft
from dflash_mlx.kernels import qmm
from dflash_mlx.kernels.emulated import emulated_backend
from dflash_mlx.targets import verify_matmuls

PROMPT = "write a short story about a cat who lived in a lighthouse by the sea"
RUNS = {  # name -> generate arguments: chains and trees, greedy and sampled
    "chain": dict(block_size=4),
    "tree": dict(block_size=4, tree_budget=6),
    "tree sampled": dict(block_size=4, tree_budget=6, temperature=0.8, seed=3),
    "chain sampled": dict(block_size=4, temperature=0.8, seed=4),
}


class PausingMLP(nn.Module):
    """A layer's MLP, unchanged, except that the first time ``thread`` calls it
    with ``rows`` tokens it waits (at most 60 s) until ``resume`` is set."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp
        self.pause = None  # (thread, rows, inside event, resume event) while armed

    def __call__(self, x):
        pause = self.pause
        if pause and threading.current_thread() is pause[0] and x.shape[1] == pause[1]:
            self.pause = None
            pause[2].set()
            pause[3].wait(60)
        return self.mlp(x)


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    model.layers[0].mlp = PausingMLP(model.layers[0].mlp)
    draft = load_draft(str(draft_dir("qwen3", block_size=8)))
    alone = {name: generate(model, draft, tokenizer, PROMPT, max_tokens=24, **kw).tokens for name, kw in RUNS.items()}
    return model, tokenizer, draft, alone


def run_threads(jobs, arm=lambda threads: None):
    """Run the (name, function) jobs in threads (``arm`` sees them before they
    start); name -> result or the exception raised."""
    results = {}

    def run(name, job):
        try:
            results[name] = job()
        except Exception as e:  # the test reports it
            results[name] = e
        finally:
            mx.clear_streams()  # or the test process may abort as it exits (docs/threads.md)

    threads = [threading.Thread(target=run, args=job, name=job[0]) for job in jobs]
    arm(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a generation thread did not finish"
    return results


def test_a_chain_runs_whole_inside_another_threads_tree_pass(pair):
    model, tokenizer, draft, alone = pair
    inside, resume = threading.Event(), threading.Event()

    def tree():
        return generate(model, draft, tokenizer, PROMPT, max_tokens=24, **RUNS["tree"]).tokens

    def chain():
        assert inside.wait(60), "the tree thread never reached a tree pass"
        try:
            return generate(model, draft, tokenizer, PROMPT, max_tokens=24, **RUNS["chain"]).tokens
        finally:
            resume.set()

    assert len(tokenizer.encode(PROMPT)) != 7
    results = run_threads([("tree", tree), ("chain", chain)],
                          # the tree thread's first MLP call over root + 6 nodes is inside its first tree pass
                          arm=lambda threads: setattr(model.layers[0].mlp, "pause", (threads[0], 7, inside, resume)))
    assert inside.is_set()
    assert results == {"tree": alone["tree"], "chain": alone["chain"]}


def test_mixed_threads_each_give_their_single_thread_output(pair):
    model, tokenizer, draft, alone = pair
    jobs = [(f"{name} {i}", lambda kw=kw: generate(model, draft, tokenizer, PROMPT, max_tokens=24, **kw).tokens)
            for i in range(2) for name, kw in RUNS.items()]
    results = run_threads(jobs)
    assert results == {f"{name} {i}": alone[name] for i in range(2) for name in RUNS}


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")
def test_a_verify_pass_leaves_other_threads_calls_to_the_layer():
    mx.random.seed(0)
    block = nn.Sequential(nn.Linear(128, 96), nn.Linear(96, 64))
    nn.quantize(block, group_size=32, bits=4)
    block.up = block.layers[0]  # a module attribute: the verify pass swaps it
    x = mx.array(np.random.default_rng(0).normal(size=(1, 8, 128)).astype(np.float32))
    want = block.up(x)
    mx.eval(block.parameters(), want)  # evaluated here: arrays are evaluated on a stream of the thread that made them
    launches = []
    launch = qmm.KERNEL.launch

    def counting_launch(*a, **k):
        if a[0].shape == (8, 128):  # block.up's input, not a self-check's
            launches.append(threading.current_thread().name)
        return launch(*a, **k)

    inside, resume = threading.Event(), threading.Event()

    def verifier():
        with kernels.use_backend(emulated_backend()):
            with verify_matmuls.verification_matmuls(block) as swapped:
                assert swapped == 1
                inside.set()
                assert resume.wait(60)
                return np.array(block.up(x))  # still this pass's kernel after the other pass ended

    def other():
        assert inside.wait(60)
        try:
            with kernels.use_backend(emulated_backend()):
                plain = np.array(block.up(x))  # not verifying: the layer itself, bit for bit
                with verify_matmuls.verification_matmuls(block):
                    mx.eval(block.up(x))
                return plain
        finally:
            resume.set()

    qmm.KERNEL.launch = counting_launch
    try:
        results = run_threads([("verifier", verifier), ("other", other)])
    finally:
        qmm.KERNEL.launch = launch
    assert not isinstance(results["verifier"], Exception), results["verifier"]
    np.testing.assert_array_equal(results["other"], np.array(want))
    np.testing.assert_allclose(results["verifier"], np.array(want), rtol=1e-4, atol=1e-4)
    assert launches == ["other", "verifier"]  # each in its own pass only
    assert "up" not in vars(block)
