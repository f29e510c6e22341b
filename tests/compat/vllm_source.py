"""Unmodified vLLM 0.33 modules for compatibility tests, from the pinned wheel.

vLLM is never a dependency and none of its code is committed. A test that
must run vLLM's own code calls `load_vllm_module`, which

1. finds the pinned wheel in the git-ignored cache `.cache/vllm-0.33.0/` at
   the repository root, or downloads it there with
   `pip download --no-deps vllm==0.33.0` (bounded in time), and checks its
   sha256 against the pinned value;
2. extracts only the requested `.py` files next to it;
3. imports the module under its real name with its heavy imports (torch,
   numpy, the config tree, ...) replaced by the small stand-ins the caller
   passes, restoring `sys.modules` afterwards.

When the wheel can be neither found nor downloaded, the calling test is
skipped with the reason. The cache directory holds a `.gitignore` of its
own, so nothing in it is ever committed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import types
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

VLLM_VERSION = "0.33.0"
WHEEL_NAME = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
DOWNLOAD_TIMEOUT_S = 900.0

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache" / f"vllm-{VLLM_VERSION}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _prepare_cache() -> None:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    ignore = CACHE_DIR.parent / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")


def vllm_wheel() -> Path:
    """The verified pinned wheel, downloading it once; skips the test if impossible."""
    _prepare_cache()
    wheel = CACHE_DIR / WHEEL_NAME
    verified = CACHE_DIR / f"{WHEEL_NAME}.sha256-ok"
    if wheel.exists() and verified.exists():
        return wheel
    if not wheel.exists():
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 f"vllm=={VLLM_VERSION}", "--dest", str(CACHE_DIR)],
                capture_output=True,
                text=True,
                timeout=DOWNLOAD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"downloading vllm=={VLLM_VERSION} took over {DOWNLOAD_TIMEOUT_S:.0f} s")
        if result.returncode != 0 or not wheel.exists():
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            pytest.skip(f"cannot download vllm=={VLLM_VERSION}: {' / '.join(tail)}")
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        wheel.unlink()
        pytest.fail(f"{wheel.name} has sha256 {actual}, expected {WHEEL_SHA256}; removed it")
    verified.write_text(actual + "\n")
    return wheel


def extracted(relative_path: str) -> Path:
    """`relative_path` (e.g. `vllm/distributed/kv_events.py`) extracted from the wheel."""
    target = CACHE_DIR / "src" / relative_path
    if not target.exists():
        with zipfile.ZipFile(vllm_wheel()) as archive:
            archive.extract(relative_path, CACHE_DIR / "src")
    return target


def load_vllm_module(
    name: str, stubs: Mapping[str, Mapping[str, Any]], *, package: bool = False
) -> types.ModuleType:
    """Import vLLM's module `name` (dotted) unmodified, with `stubs` standing in for its imports.

    `stubs` maps module names to the attributes their stand-ins carry. Parent
    packages are created empty. `package=True` loads the package's
    `__init__.py`. `sys.modules` is restored afterwards; the loaded module
    keeps its references to the stand-ins.
    """
    relative = name.replace(".", "/") + ("/__init__.py" if package else ".py")
    path = extracted(relative)
    wanted = {name, *stubs}
    for module_name in list(wanted):
        parts = module_name.split(".")
        wanted.update(".".join(parts[:end]) for end in range(1, len(parts)))
    saved = {module_name: sys.modules.get(module_name) for module_name in wanted}
    try:
        for module_name in sorted(wanted - {name}):
            module = types.ModuleType(module_name)
            module.__dict__.update(stubs.get(module_name, {}))
            sys.modules[module_name] = module
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        for module_name, previous in saved.items():
            if previous is None:
                sys.modules.pop(module_name, None)
            else:
                sys.modules[module_name] = previous
