"""The vLLM general plugin, against a stand-in `vllm` package written to a temp dir.

The stand-in has just what the plugin touches: `vllm.__version__`, the module
defining `DPCoordinator` (`vllm.v1.engine.coordinator`) and the launcher module
that imports the name from it (`vllm.v1.engine.utils`), whose
`launch_core_engines` builds the coordinator with vLLM 0.33's call shape.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from coordinator import vllm_plugin
from coordinator.vllm_compat import DPCoordinatorProcess

STANDIN_FILES = {
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/coordinator.py": """
        class DPCoordinator:
            '''vLLM's own coordinator (stand-in).'''

            def __init__(self, parallel_config, enable_wave_coordination=True,
                         logging_config=None):
                raise AssertionError("vLLM's own coordinator must not start in these tests")

        HEARTBEAT_S = 5.0
        """,
    "vllm/v1/engine/utils.py": """
        from vllm.v1.engine.coordinator import DPCoordinator

        def launch_core_engines(parallel_config, is_moe):
            coordinator = DPCoordinator(
                parallel_config, enable_wave_coordination=is_moe, logging_config=None
            )
            engine_in, engine_out = coordinator.get_engine_socket_addresses()
            return coordinator, engine_in, engine_out, coordinator.get_stats_publish_address()
        """,
}


def _purge_vllm() -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


StandIn = Callable[[str | None], Path]


@pytest.fixture
def standin_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    """Write a stand-in vLLM reporting `version` (None: no __version__) and put it on sys.path."""

    def make(version: str | None) -> Path:
        root = tmp_path / "site"
        for relative, text in STANDIN_FILES.items():
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        init = "" if version is None else f"__version__ = {version!r}\n"
        (root / "vllm" / "__init__.py").write_text(init)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        return root

    _purge_vllm()
    monkeypatch.delenv("DP_COORDINATOR_REPLACE", raising=False)
    yield make
    _purge_vllm()


def defining_module() -> ModuleType:
    return importlib.import_module("vllm.v1.engine.coordinator")


def public_names(module: ModuleType) -> dict[str, object]:
    return {k: v for k, v in vars(module).items() if not k.startswith("__")}


# ---- no-op unless asked -------------------------------------------------------------------


def test_importing_the_plugin_imports_no_vllm(standin_vllm: StandIn) -> None:
    """Checked in a fresh interpreter, with a vLLM importable on its path."""
    root = standin_vllm("0.33.0")
    code = (
        "import sys, coordinator.vllm_plugin as p\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
        "print('coordinator.vllm_compat' in sys.modules, 'zmq' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": f"{root}:{Path(__file__).parents[2]}", "DP_COORDINATOR_REPLACE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "False False"]


@pytest.mark.parametrize("value", [None, "", "0", "false", "no"])
def test_register_does_nothing_unless_enabled(
    standin_vllm: StandIn, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    standin_vllm("0.33.0")
    if value is not None:
        monkeypatch.setenv("DP_COORDINATOR_REPLACE", value)
    vllm_plugin.register()
    assert "vllm" not in sys.modules  # not even imported
    assert defining_module().DPCoordinator is not DPCoordinatorProcess


# ---- the patch ---------------------------------------------------------------------------


def test_patches_the_defining_module_before_the_launcher_imports_it(
    standin_vllm: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin_vllm("0.33.0")
    before = public_names(defining_module())
    monkeypatch.setenv("DP_COORDINATOR_REPLACE", "1")
    vllm_plugin.register()
    after = public_names(defining_module())
    assert after.pop("DPCoordinator") is DPCoordinatorProcess
    before.pop("DPCoordinator")
    assert after == before  # nothing else changed
    assert "vllm.v1.engine.utils" not in sys.modules  # the heavy launcher is not imported
    launcher = importlib.import_module("vllm.v1.engine.utils")
    assert launcher.DPCoordinator is DPCoordinatorProcess


def test_patches_a_launcher_that_already_copied_the_name(
    standin_vllm: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin_vllm("0.33.0")
    launcher = importlib.import_module("vllm.v1.engine.utils")
    original = launcher.DPCoordinator
    monkeypatch.setenv("DP_COORDINATOR_REPLACE", "1")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads plugins in every process, sometimes more than once
    assert launcher.DPCoordinator is DPCoordinatorProcess
    assert defining_module().DPCoordinator is DPCoordinatorProcess
    assert original is not DPCoordinatorProcess


def test_the_patched_launcher_starts_our_process(
    standin_vllm: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin_vllm("0.33.0+cu129")
    monkeypatch.setenv("DP_COORDINATOR_REPLACE", "1")
    vllm_plugin.register()
    launcher = importlib.import_module("vllm.v1.engine.utils")
    config = SimpleNamespace(
        data_parallel_size=2, data_parallel_size_local=2, data_parallel_master_ip="127.0.0.1",
        local_engines_only=False, enable_elastic_ep=False,
    )
    coordinator, engine_in, engine_out, stats = launcher.launch_core_engines(config, True)
    try:
        assert isinstance(coordinator, DPCoordinatorProcess)
        assert coordinator.proc.is_alive()
        assert (engine_in, engine_out) == (coordinator.addresses["back_publish"],
                                           coordinator.addresses["back_output"])
        assert stats == coordinator.addresses["front_publish"]
        assert all(a.startswith("ipc://") for a in (engine_in, engine_out, stats))
    finally:
        coordinator.shutdown()
    assert not coordinator.proc.is_alive()


# ---- versions ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [
    "0.28.2", "0.34.0", "1.33.0", "0.33.0rc1", "0.33.1.dev12+g4ba787ec9", "0.33", "dev", None,
])
def test_refuses_versions_it_does_not_target(
    standin_vllm: StandIn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    version: str | None,
) -> None:
    standin_vllm(version)
    monkeypatch.setenv("DP_COORDINATOR_REPLACE", "1")
    with caplog.at_level(logging.WARNING, logger="coordinator.vllm_plugin"):
        vllm_plugin.register()
    assert defining_module().DPCoordinator is not DPCoordinatorProcess
    assert "vllm.v1.engine.utils" not in sys.modules
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert (f"vLLM {version} is not a version dp-coordinator targets (0.29.x to 0.33.x): "
            in record.message)
    why = {"0.28.2": "older than any release", "0.34.0": "newer than the last release checked",
           "1.33.0": "newer than the last release checked", None: "no version string"}
    assert why.get(version, "not a final release") in record.message


@pytest.mark.parametrize(("version", "targeted"), [
    ("0.29.0", True),
    ("0.30.1", True),
    ("0.32.2", True),
    ("0.28.9", False),
    ("0.33.0", True),
    ("0.33.4", True),
    ("0.33.0+cu129", True),
    ("0.33.1.post1", True),
    (" 0.33.0 ", True),
    ("0.33.0rc2", False),
    ("0.33.0.dev1", False),
    ("0.330.0", False),
    ("10.33.0", False),
    ("0.34.0", False),
    ("", False),
    (33, False),
])
def test_is_targeted_version(version: object, targeted: bool) -> None:
    assert vllm_plugin.is_targeted_version(version) is targeted


def test_enabled_without_vllm_only_warns(
    standin_vllm: StandIn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    monkeypatch.setenv("DP_COORDINATOR_REPLACE", "1")
    with caplog.at_level(logging.WARNING, logger="coordinator.vllm_plugin"):
        vllm_plugin.register()
    assert "vLLM is not importable" in caplog.text


def test_a_vllm_without_the_class_is_left_alone(
    standin_vllm: StandIn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = standin_vllm("0.33.0")
    (root / "vllm/v1/engine/coordinator.py").write_text("RENAMED = True\n")
    monkeypatch.setenv("DP_COORDINATOR_REPLACE", "1")
    with caplog.at_level(logging.WARNING, logger="coordinator.vllm_plugin"):
        vllm_plugin.register()
    assert not hasattr(defining_module(), "DPCoordinator")
    assert "has no DPCoordinator" in caplog.text


# ---- the entry point ---------------------------------------------------------------------


def test_entry_point_value_loads_the_plugin() -> None:
    """The value pyproject.toml registers, loaded the way vLLM loads general plugins."""
    entry = importlib.metadata.EntryPoint(
        name=vllm_plugin.ENTRY_POINT_NAME, value="coordinator.vllm_plugin:register",
        group="vllm.general_plugins",
    )
    assert entry.load() is vllm_plugin.register
