"""The package builds from a copy of the repository the way `pip install <path>` builds it.

This is the install route the docs give (the package is not on a public
index): pip builds a wheel with the build backend of `pyproject.toml` in an
isolated environment. The build must be free of setuptools' warnings, and the
metadata must keep the Apache-2.0 license.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_builds_without_a_license_warning(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "coordinator", source / "coordinator",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheel"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=240,
    )
    log = built.stdout + built.stderr
    assert built.returncode == 0, log
    assert "project.license" not in log, log
    # setuptools' warnings reach pip's output as BuildBackendWarning (or a
    # SetuptoolsDeprecationWarning on older pips).
    assert "BuildBackendWarning" not in log and "DeprecationWarning" not in log, log
    (wheel,) = out.glob("dp_coordinator-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_name).decode()
        names = archive.namelist()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "coordinator/py.typed" in names
    assert "coordinator/__main__.py" in names
