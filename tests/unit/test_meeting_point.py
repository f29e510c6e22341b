"""The DP meeting point every INIT carries, row by row."""

from __future__ import annotations

import pytest

from coordinator.core.meeting_point import (
    FREE_PORTS,
    meeting_host,
    needs_free_ports,
    parallel_config,
)

FREE = [40000 + i for i in range(FREE_PORTS)]


def config(**overrides: object) -> dict[str, object]:
    args: dict[str, object] = {
        "lockstep": True, "host": None, "master_ip": None, "master_port": None,
        "master_port_list": [], "coord_store_port": None, "data_parallel_size": 4,
        "free_ports": FREE,
    }
    args.update(overrides)
    return parallel_config(**args)  # type: ignore[arg-type]


def test_by_default_rank_0_meets_on_the_coordinators_host_at_free_ports() -> None:
    assert config(host="10.0.0.5") == {
        "data_parallel_master_ip": "10.0.0.5", "data_parallel_master_port": 40000,
        "_data_parallel_master_port_list": FREE[1:], "data_parallel_size": 4,
    }


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::"])
def test_ipc_and_wildcard_binds_meet_on_loopback(host: str | None) -> None:
    assert meeting_host(host) == "127.0.0.1"
    assert config(host=host)["data_parallel_master_ip"] == "127.0.0.1"


def test_given_ports_win_over_free_ones() -> None:
    out = config(master_port=29500, master_port_list=[29600, 29601], coord_store_port=29700)
    assert out["data_parallel_master_port"] == 29500
    assert out["_data_parallel_master_port_list"] == [29600, 29601]
    assert out["_coord_store_port"] == 29700


def test_a_remote_master_gets_the_five_ports_above_its_own() -> None:
    assert not needs_free_ports(lockstep=True, master_ip="10.0.0.9")
    out = config(master_ip="10.0.0.9", master_port=29500, free_ports=())
    assert out["data_parallel_master_ip"] == "10.0.0.9"
    assert out["_data_parallel_master_port_list"] == [29501, 29502, 29503, 29504, 29505]


def test_dense_mode_has_no_meeting_point() -> None:
    assert not needs_free_ports(lockstep=False, master_ip=None)
    assert config(lockstep=False, free_ports=()) == {}


def test_missing_free_ports_is_a_bug_of_the_caller() -> None:
    assert needs_free_ports(lockstep=True, master_ip=None)
    with pytest.raises(ValueError, match="need 6 free ports"):
        config(free_ports=[1, 2])
