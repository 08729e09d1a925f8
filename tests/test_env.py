"""python -m cswap.env: the version report a bug report asks for (issue 24 §6)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
import torch
from packaging.specifiers import SpecifierSet

import cswap
from cswap import env


def test_the_report_names_versions_devices_backend_and_profile():
    run = subprocess.run([sys.executable, "-m", "cswap.env"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert f"cswap {cswap.__version__}" in out
    assert f"torch {torch.__version__}" in out
    assert f"triton {metadata.version('triton')}" in out
    assert f"numpy {np.__version__}" in out
    assert "GPU: none" in out if not torch.cuda.is_available() else "compute capability" in out
    expected_backend = "Triton kernels on CUDA tensors" if torch.cuda.is_available() else "PyTorch reference"
    assert f"codecs run: {expected_backend}" in out
    assert "profile: " in out and "CSWAP_HOME" in out


def test_the_versions_under_test_are_inside_the_declared_ranges():
    """CI runs this on both version jobs: pyproject.toml claims what they test."""
    ranges = env.tested_ranges()
    if not ranges:
        pytest.skip("cswap is not installed (a source tree on sys.path): no metadata to read")
    assert {"torch", "triton", "numpy", "python"} <= set(ranges)
    report = env.report()
    for name in ("torch", "triton"):
        line = next(line for line in report.splitlines() if line.startswith(f"{name} "))
        assert line.endswith(": yes)"), line


def test_a_version_outside_the_range_is_named():
    spec = {"torch": SpecifierSet(">=2.11,<2.16")}
    assert env._range_note("torch", "2.15.0+cu132", spec).endswith(": yes)")
    assert "NO, outside" in env._range_note("torch", "2.10.0", spec)
    assert "NO, outside" in env._range_note("torch", "2.16.0", spec)
    assert env._range_note("torch", None, spec) == "" and env._range_note("lz4", "4.3", spec) == ""


def test_main_prints_the_report(capsys):
    assert env.main([]) == 0
    assert capsys.readouterr().out.startswith(f"cswap {cswap.__version__}")
