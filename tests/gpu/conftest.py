"""GPU tests: fast backends against the plain-PyTorch references. Every measured relative error is also appended
to the JSON file named by ``OPENK3_ERRLOG`` (bench/run_all.py sets it) so tolerances can be set from data."""

import json
import os
import subprocess
import sys

import pytest
import torch

_LOG: list[dict] = []


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("OPENK3_ERRLOG")
    if path and _LOG:
        with open(path, "w") as f:
            json.dump(_LOG, f, indent=1)


@pytest.fixture
def check():
    """check(name, got, want, tol): relative error ||got - want|| / ||want|| (fp64) <= tol; NaN never passes."""

    def _check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        a, b = got.detach().double(), want.detach().double()
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err = float((a - b).norm() / b.norm().clamp_min(1e-300))
        _LOG.append({"name": name, "err": err, "tol": tol})
        print(f"\n  relerr {name} = {err:.3e} (tol {tol:.1e}){'' if err <= tol else '  FAIL'}", flush=True)
        assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.1e}"
        return err

    return _check


@pytest.fixture
def errlog():
    """The list the measured errors go to (append dicts with name/err/tol and anything else worth keeping)."""
    return _LOG


@pytest.fixture
def run_interpreted():
    """run(script, hide_cuda=False) -> the float the script prints after "WORST": runs ``script`` in a fresh Python
    under TRITON_INTERPRET=1 (the interpreter must be chosen before any Triton kernel is defined) with this checkout's
    ``src`` first on PYTHONPATH; fails with the script's stderr when it exits non-zero. ``hide_cuda`` hides GPUs."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (os.path.join(root, "src"), os.environ.get("PYTHONPATH")) if p)

    def _run(script: str, hide_cuda: bool = False) -> float:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
        if hide_cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return float(out.stdout.split("WORST")[-1])

    return _run
