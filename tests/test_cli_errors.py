"""Bad generate and bench options through the real entry point (``python -m
dflash_mlx``): exit status 1, exactly one ``error:`` line, no traceback and
nothing written. The target does not exist and the draft is a config.json
without weights, so every error here is raised before any model loads."""

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def config_only(draft_dir, tmp_path_factory):
    """A draft directory with its config.json (trained block size 8) and no weights."""
    path = tmp_path_factory.mktemp("config-only")
    (path / "config.json").write_text((draft_dir("qwen3") / "config.json").read_text())
    return path


def dflash(*args, cwd, input=None):
    argv = [a if isinstance(a, bytes) else os.fsencode(str(a)) for a in args]
    proc = subprocess.run([sys.executable, "-m", "dflash_mlx", *argv], capture_output=True,
                          input=input if input is not None else b"", cwd=cwd)
    return proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")


def assert_one_error(result, fragment):
    code, out, err = result
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert out == ""


GENERATE = [  # the rest of generate's range checks run in-process in test_cli.py
    (["-b", "2.5"], "Invalid value for '--block-size'"),
    (["-b", "100000"], "--block-size must be at most 16 (2x the draft's trained block size 8), got 100000"),
    (["-n", "5.5"], "Invalid value for '--max-tokens'"),
    (["--temp", "nan"], "--temp must be a finite number"),
    (["--temp", "inf"], "--temp must be a finite number"),
    (["--repetition-penalty", "-1"], "--repetition-penalty must be > 0, got -1"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--seed", str(2**64)], "--seed must be below 18446744073709551616"),
]


@pytest.mark.parametrize("args, fragment", GENERATE)
def test_generate_rejects_before_loading(config_only, tmp_path, args, fragment):
    result = dflash("generate", "-m", tmp_path / "nowhere", "-d", config_only, "-p", "hi", *args, cwd=tmp_path)
    assert_one_error(result, fragment)
    assert os.listdir(tmp_path) == []


def test_generate_prompt_must_be_valid_utf8(config_only, tmp_path):
    base = ["generate", "-m", tmp_path / "nowhere", "-d", config_only]
    assert_one_error(dflash(*base, "-p", b"caf\xc3", cwd=tmp_path), "the prompt is not valid UTF-8")
    assert_one_error(dflash(*base, "-p", "-", input=b"caf\xff\xfe", cwd=tmp_path),
                     "the prompt is not valid UTF-8")
    assert_one_error(dflash(*base, cwd=tmp_path), "Missing option '--prompt'")


def test_generate_stop_and_system_must_be_valid_utf8(config_only, tmp_path):
    base = ["generate", "-m", tmp_path / "nowhere", "-d", config_only, "-p", "hi"]
    assert_one_error(dflash(*base, "--stop", "x", "--stop", b"\xff", cwd=tmp_path), "the --stop string is not valid UTF-8")
    assert_one_error(dflash(*base, "--system", b"caf\xc3", cwd=tmp_path), "the --system text is not valid UTF-8")
    assert os.listdir(tmp_path) == []


def generate_into(stdout, target, draft, cwd):
    """Exit status and stderr of a short greedy generation whose stdout is ``stdout``."""
    proc = subprocess.run([sys.executable, "-m", "dflash_mlx", "generate", "-m", str(target), "-d", str(draft),
                           "-p", "hello world", "-n", "8", "--no-chat-template"],
                          stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=cwd, timeout=300)
    return proc.returncode, proc.stderr.decode(errors="replace")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_generate_into_a_full_disk_says_so_in_one_line(target_dirs, draft_dir, tmp_path):
    with open("/dev/full", "wb") as full:
        code, err = generate_into(full, target_dirs["qwen3"], draft_dir("qwen3"), tmp_path)
    assert code == 1 and err.splitlines() == ["error: cannot write the output to stdout: No space left on device"], err


def test_generate_into_a_closed_pipe_says_so_in_one_line(target_dirs, draft_dir, tmp_path):
    read, write = os.pipe()
    os.close(read)
    try:
        code, err = generate_into(write, target_dirs["qwen3"], draft_dir("qwen3"), tmp_path)
    finally:
        os.close(write)
    assert code == 1 and err.splitlines() == ["error: cannot write the output to stdout: Broken pipe"], err


BENCH = [
    (["--temp", "nan"], "--temp must be a finite number"),
    (["--repeat", "0"], "--repeat must be positive, got 0"),
    (["-b", "100000"], "--block-size must be at most 16"),
]


@pytest.mark.parametrize("args, fragment", BENCH)
def test_bench_rejects_before_loading(config_only, tmp_path, args, fragment):
    result = dflash("bench", "-m", tmp_path / "nowhere", "-d", config_only, *args, cwd=tmp_path)
    assert_one_error(result, fragment)
    assert os.listdir(tmp_path) == []


def test_bench_json_must_be_a_writable_file(config_only, tmp_path):
    base = ["bench", "-m", tmp_path / "nowhere", "-d", config_only]
    assert_one_error(dflash(*base, "--json", tmp_path, cwd=tmp_path), "is a directory; give a file name")
    (tmp_path / "file").write_text("x")
    assert_one_error(dflash(*base, "--json", tmp_path / "file" / "r.json", cwd=tmp_path),
                     "is not a writable directory")
    assert os.listdir(tmp_path) == ["file"]  # no stray temporary files beside or above the target


def test_bench_prints_the_table_then_writes_the_json_atomically(target_dirs, draft_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world", "id": "a"}) + "\n")
    code, out, err = dflash("bench", "-m", target_dirs["qwen3"], "-d", draft_dir("qwen3", block_size=4),
                            "--prompts", prompts, "-n", "4", "-b", "6", "--no-warmup",
                            "--json", tmp_path / "new" / "r.json", cwd=tmp_path)
    assert code == 0, err
    assert "DFlash b=6" in out and "Traceback" not in err
    warnings = [line for line in err.splitlines() if "warning" in line.lower()]
    assert warnings == ["warning: --block-size 6 is above the draft's trained block size 4: "
                        "acceptance at draft positions beyond 4 is untrained"]
    assert sorted(os.listdir(tmp_path)) == ["new", "p.jsonl"] and os.listdir(tmp_path / "new") == ["r.json"]
    assert json.loads((tmp_path / "new" / "r.json").read_text())["config"]["block_sizes"] == [6]
