"""The built wheel, installed into a fresh venv (not editable, outside the
repository), ships what users run: every module, the console script, the
converter, the Metal kernel sources with the emulation header, and the bundled
demo pair."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(venv directory, its python) with only the built wheel of this checkout
    installed; dependencies come from the test environment's site-packages,
    added as a plain path so that the editable install's finder is not."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "demo_work"))
    try:  # build offline when this environment has a wheel-capable setuptools
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation,
                    "-w", str(tmp / "dist"), str(src)], check=True)
    shutil.rmtree(src)
    (wheel,) = (tmp / "dist").glob("dflash_mlx-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    str(wheel)], check=True)
    return env_dir, python


def run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          env={**env, "COLUMNS": "200", **kw.pop("env", {})}, **kw)


def test_the_wheel_is_what_the_venv_imports(wheel_venv, tmp_path):
    env_dir, python = wheel_venv
    out = run([python, "-c", "import dflash_mlx, dflash_mlx.convert as c; print(dflash_mlx.__file__);"
               "print(c.__file__)"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for path in out.stdout.split():
        assert Path(path).resolve().is_relative_to(env_dir.resolve()), path
        assert not Path(path).resolve().is_relative_to(REPO), path


def test_the_wheel_ships_every_module_of_the_checkout(wheel_venv, tmp_path):
    """Every subpackage (loop/, targets/, ...) is in pyproject's package list:
    the installed package holds each module of dflash_mlx/ and convert/."""
    _, python = wheel_venv
    out = run([python, "-c", "import pathlib, dflash_mlx; root = pathlib.Path(dflash_mlx.__file__).parent;"
               "print('\\n'.join(p.relative_to(root).as_posix() for p in root.rglob('*.py')))"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shipped = set(out.stdout.split())
    checkout = {p.relative_to(REPO / "dflash_mlx").as_posix() for p in (REPO / "dflash_mlx").rglob("*.py")}
    checkout |= {f"convert/{p.relative_to(REPO / 'convert').as_posix()}" for p in (REPO / "convert").rglob("*.py")}
    assert {"loop/__init__.py", "loop/decoder.py", "targets/__init__.py", "targets/adapter.py"} <= checkout
    assert not checkout - shipped, sorted(checkout - shipped)


def test_console_script_exposes_the_converter(wheel_venv, tmp_path):
    env_dir, _ = wheel_venv
    out = run([env_dir / "bin" / "dflash-mlx", "convert", "--help"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for option in ["--out", "--q-bits", "--q-group-size", "--dtype", "--force", "--recipe", "--target"]:
        assert option in out.stdout, option
    bad = run([env_dir / "bin" / "dflash-mlx", "convert", str(tmp_path / "nowhere"), "--out",
               str(tmp_path / "out")], cwd=tmp_path)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error:"), bad.stderr
    assert not (tmp_path / "out").exists()


def test_wheel_ships_the_metal_sources_and_the_harness(wheel_venv, tmp_path):
    env_dir, python = wheel_venv
    script = """
import dflash_mlx.kernels as k
from dflash_mlx.emulate import HEADER
print(k.metal_dir().resolve())
for kernel in k.KERNELS.values():
    assert kernel.source and kernel.header, kernel
assert HEADER.is_file()
print(sorted(p.name for p in k.metal_dir().iterdir()))
"""
    if shutil.which("g++"):  # the harness compiles and runs every kernel from the installed copy
        script += "from dflash_mlx.kernels.emulated import main\nassert main([]) == 0\n"
    out = run([python, "-c", script], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    where, names = out.stdout.splitlines()[:2]
    assert Path(where).is_relative_to(env_dir.resolve()), where
    for name in ("verify_greedy.metal", "verify_sampled.metal", "kv_inject.metal", "qmm_verify.metal",
                 "gdn_verify.metal", "gdn_replay.metal", "gdn_tree_verify.metal", "common.h"):
        assert name in names, name


def test_wheel_ships_the_demo_pair_when_the_checkout_has_it(wheel_venv, tmp_path):
    from dflash_mlx import DFlashError
    from dflash_mlx.demo import demo_pair

    try:
        demo_pair()
    except DFlashError:
        pytest.skip("the bundled demo pair is not in this checkout")
    _, python = wheel_venv
    out = run([python, "-c", "import json; from dflash_mlx.demo import demo_pair; p = demo_pair();"
               "print(json.dumps([str(p.target), str(p.draft), len(p.load_prompts())]))"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    target, draft, prompts = json.loads(out.stdout)
    assert not Path(target).resolve().is_relative_to(REPO) and prompts > 0
    assert (Path(target) / "tokenizer.json").is_file() and list(Path(draft).glob("*.safetensors"))
