"""`coordinator.sim` exposes every public name of its modules, each loaded on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import coordinator.sim as sim

pytestmark = pytest.mark.timeout(30)


def test_every_public_name_is_its_defining_modules_object() -> None:
    assert sorted(sim.__all__) == sorted(sim._HOMES)
    for name in sim.__all__:
        home = importlib.import_module(f"coordinator.sim.{sim._HOMES[name]}")
        assert getattr(sim, name) is getattr(home, name), name
        assert name in getattr(home, "__all__", [name]), name
    assert set(sim.__all__) <= set(dir(sim))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'SimGroup'"):
        _ = sim.SimGroup
    with pytest.raises(ImportError):
        exec("from coordinator.sim import SimGroup", {})


def test_the_load_generator_loads_its_traffic_modules_without_the_engine_model() -> None:
    probe = ("import sys, coordinator.loadgen; "
             "print(sorted(m for m in sys.modules if m.startswith('coordinator.sim')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=20, check=True).stdout
    assert out.strip() == str(["coordinator.sim", "coordinator.sim.outputs",
                               "coordinator.sim.request", "coordinator.sim.traffic",
                               "coordinator.sim.workload"])
