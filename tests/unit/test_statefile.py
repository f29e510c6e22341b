"""Writing the state file: a failed write leaves no temporary file behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.core.persisted import STATE_VERSION, SavedState
from coordinator.server.statefile import load_state, save_state

EMPTY = SavedState(version=STATE_VERSION, wave=0, gate_open=False, inits_sent=False,
                   leases=[], frontends=[], addresses={})


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.mkdir()  # os.replace onto a directory fails after the temp file is written
    with pytest.raises(OSError):
        save_state(str(target), EMPTY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_loading_removes_this_files_stale_temporaries_only(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    save_state(str(target), EMPTY)
    (tmp_path / ".state.json.state-abc12345").write_bytes(b"half")
    (tmp_path / ".other.json.state-abc12345").write_bytes(b"theirs")
    assert load_state(str(target)) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".other.json.state-abc12345", "state.json"]
