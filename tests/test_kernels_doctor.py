"""``dflash-mlx doctor``: platform, MLX backend, Metal, kernel states, BLAS."""

import platform

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_mlx import doctor, kernels
from dflash_mlx.cli import app




def test_doctor_command_reports_everything():
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"mlx{' ' * 2}" in out and mx.__version__ in out
    assert "platform" in out and platform.machine() in out
    assert "mlx backend" in out and "metal" in out
    for name in kernels.KERNELS:
        assert f"kernel {name}" in out
    if not mx.metal.is_available():
        assert "reference (no metal backend)" in out
    if platform.system() == "Linux":
        assert "blas " in out


def test_doctor_shows_forced_active_and_disabled_kernels(monkeypatch):
    class Wrong:
        def __init__(self, **kw):
            pass

        def __call__(self, *, output_shapes, output_dtypes, **kw):
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setenv(kernels.REFERENCE_ENV, "verify_greedy")
    with kernels.use_policy(kernels.KernelPolicy.from_env(backend=kernels.Backend("wrong", lambda: True, Wrong))):
        with pytest.warns(RuntimeWarning, match="kv_inject"):
            rows = dict(doctor.collect())
    assert rows["kernel verify_greedy"] == f"reference (forced by {kernels.REFERENCE_ENV})"
    assert rows["kernel kv_inject"].startswith("disabled by self-check (keys: ")
    assert rows[kernels.REFERENCE_ENV] == "verify_greedy"


def test_doctor_without_self_checks_leaves_kernels_unchecked():
    class Spy:
        built = 0

        def __init__(self, **kw):
            Spy.built += 1

    with kernels.use_backend(kernels.Backend("spy", lambda: True, Spy)):
        rows = dict(doctor.collect(check=False))
    assert rows["kernel kv_inject"] == "unchecked" and Spy.built == 0


@pytest.mark.skipif(platform.system() != "Linux", reason="BLAS report is for MLX's Linux CPU backend")
def test_blas_detection(monkeypatch):
    bundled = "/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
    numpy_openblas = "/venv/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"
    which, advice = doctor.blas_report([bundled, numpy_openblas])
    assert which.startswith("reference BLAS bundled with mlx[cpu]") and "LD_PRELOAD=" in advice
    which, advice = doctor.blas_report([bundled, "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"])
    assert which.startswith("OpenBLAS") and advice is None
    monkeypatch.setattr(doctor, "OPENBLAS_LIB", "/nonexistent/libblas.so.3")
    _, advice = doctor.blas_report([bundled])
    assert "apt-get install libopenblas0-pthread" in advice
