"""`make demo` installs only what the demo needs: the package and its runtime
dependencies, not the dev and bench extras (most of the install time), and the demo
runs from such an environment."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


@needs_make
def test_make_demo_installs_the_runtime_only() -> None:
    planned = subprocess.run(["make", "-n", "-B", "demo", "VENV=/nonexistent/venv"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    installs = [line for line in planned.stdout.splitlines() if "pip install" in line]
    assert installs == ["/nonexistent/venv/bin/python -m pip install -q -e ."], installs


@needs_make
@pytest.mark.timeout(600)
def test_make_demo_runs_from_a_runtime_only_environment(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    summary = tmp_path / "summary.json"
    ran = subprocess.run(
        ["make", "demo", f"VENV={venv}", f"PY={sys.executable}",
         f"ARGS=--duration 2 --rate 50 --no-live --json {summary}"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list",
                                "--format", "json"], capture_output=True, text=True,
                               timeout=120)
    names = {item["name"].lower() for item in json.loads(installed.stdout)}
    assert "dp-coordinator" in names and "pyzmq" in names
    assert not names & {"pytest", "mypy", "ruff", "hypothesis", "matplotlib"}, names
    result = json.loads(summary.read_text())
    assert result["healthy"] is True and result["error"] is None, result
    assert result["summary"]["lost"] == 0, result
