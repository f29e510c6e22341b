"""The plugin and the drop-in with each supported vLLM release's own launcher module.

For each release (`vllm_version`, see tests/conftest.py), that release's
`vllm/v1/engine/utils.py` (the launcher: `launch_core_engines` builds the
coordinator through its module-level name `DPCoordinator`) and
`vllm/v1/engine/coordinator.py` run unmodified from its wheel. The plugin's
`register` must patch both names; the coordinator is then built through the
launcher module's name, with the arguments that release's launcher passes
(its own `DPCoordinator.__init__` says which: `logging_config` from 0.31 on),
and used the way the launcher and the API server use it: the engine socket
addresses go to the engines, the stats address to the API servers' stats
tasks, `proc.pid` is logged, `shutdown()` at the end.
"""

from __future__ import annotations

import inspect
import logging
import time

import pytest
import zmq

from coordinator import vllm_plugin
from coordinator.vllm_compat import DPCoordinatorProcess
from tests.compat.test_dropin import ParallelConfigStandIn, start_engines, vllm_frontend
from tests.vllm_peers import READY, stats_report, unpack, wait_until
from tools import vllm_wheel

pytestmark = pytest.mark.timeout(120)

LAUNCHER = ("vllm.v1.engine.coordinator", "vllm.v1.engine.utils")
RANKS = 2


def test_the_release_launcher_runs_dp_coordinator(
        vllm_version: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    monkeypatch.delenv(vllm_plugin.ROUTE_ENV, raising=False)
    try:
        vllm_wheel.extract([*vllm_wheel.COORDINATOR_REAL, *LAUNCHER], version=vllm_version,
                           timeout_s=600)
    except vllm_wheel.WheelUnavailable as exc:
        pytest.skip(f"vLLM {vllm_version} wheel unavailable: {exc}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    coord: DPCoordinatorProcess | None = None
    try:
        with vllm_wheel.vllm_modules(*LAUNCHER, stand_ins={"vllm": {"__version__": vllm_version}},
                                     version=vllm_version) as mods:
            defining, launcher = mods["vllm.v1.engine.coordinator"], mods["vllm.v1.engine.utils"]
            own = defining.DPCoordinator
            assert launcher.DPCoordinator is own  # the launcher copied the name at import
            takes = inspect.signature(own.__init__).parameters
            with caplog.at_level(logging.INFO, logger="coordinator.vllm_plugin"):
                vllm_plugin.register()
            assert defining.DPCoordinator is DPCoordinatorProcess
            assert launcher.DPCoordinator is DPCoordinatorProcess
            assert f"vLLM {vllm_version} will run dp-coordinator" in caplog.text
            # launch_core_engines' call: the config, the MoE switch, logging_config if taken.
            kwargs = {"enable_wave_coordination": True}
            if "logging_config" in takes:
                kwargs["logging_config"] = None
            coord = launcher.DPCoordinator(ParallelConfigStandIn(RANKS, RANKS), **kwargs)
        assert coord is not None and coord.proc.pid > 0
        started = time.monotonic()
        engines = start_engines(ctx, coord, RANKS)
        for engine in engines:
            assert engine.expect_publish(20.0) == [READY]
        front = vllm_frontend(ctx, coord)
        engines[1].report(stats_report(1, waiting=3, running=1, step=1))
        rows = wait_until(lambda: (r := unpack(front.next_full_publish(5.0))[0])[1][0] == 3
                          and r, timeout=20.0, what="rank 1's row on the stats address")
        assert rows == [[0, 0, 0.0], [3, 1, 0.0]]
        print(f"vLLM {vllm_version}: launcher's DPCoordinator patched, built with "
              f"{sorted(kwargs)}, {RANKS} engines up and rows published in "
              f"{time.monotonic() - started:.2f} s")
    finally:
        if coord is not None:
            coord.shutdown()
            assert not coord.proc.is_alive()
        ctx.destroy(linger=0)
