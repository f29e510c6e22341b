"""The names the README and users rely on stay where they were, whatever moved inside."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import pytest

import coordinator._zmq as plumbing
import coordinator.engine as engine
import coordinator.frontend as frontend
import coordinator.protocol as protocol
from coordinator.protocol import engine_input
from coordinator.protocol import frontend as fp


@pytest.mark.parametrize("dotted", [
    "coordinator.engine.EngineAgent",
    "coordinator.frontend.FrontendClient",
    "coordinator.sim.SimEngineGroup",
    "coordinator.sim.SimEngine",
    "coordinator.sim.SimRequest",
    "coordinator.sim.encode_sim_request",
    "coordinator.sim.CollectiveHub",
    "coordinator.loadgen.LoadGenerator",
    "coordinator.launch.launch",
    "coordinator.vllm_compat.DPCoordinatorProcess",
    "coordinator.vllm_plugin.register",
    "coordinator.cli.main",
    "coordinator.engine.CurveClientKeys",
    "coordinator.frontend.group_state_to_builtins",
])
def test_public_name_is_importable(dotted: str) -> None:
    module, _, name = dotted.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_installed_entry_points_load() -> None:
    (script,) = entry_points(group="console_scripts", name="dp-coordinator")
    (plugin,) = entry_points(group="vllm.general_plugins", name="dp_coordinator")
    assert (script.value, plugin.value) == ("coordinator.cli:main",
                                            "coordinator.vllm_plugin:register")
    assert script.load() is importlib.import_module("coordinator.cli").main
    assert callable(plugin.load())


def test_re_exports_are_the_same_objects() -> None:
    assert engine.CurveClientKeys is plumbing.CurveClientKeys
    assert frontend.group_state_to_builtins is fp.group_state_to_builtins
    for name in ("StartDpWave", "AddRequest", "AbortRequests", "UtilityCall"):
        assert getattr(engine, name) is getattr(engine_input, name)
        assert name in engine.__all__


def test_one_protocol_version() -> None:
    assert engine.PROTOCOL_VERSION is fp.PROTOCOL_VERSION is protocol.PROTOCOL_VERSION
    assert fp.Register(1, 0, "ipc:///x").protocol_version == engine.PROTOCOL_VERSION
