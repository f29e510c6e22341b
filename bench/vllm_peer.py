"""Run vLLM's own DP coordinator as a benchmark peer.

    python -m bench --peer-name vllm-0.33 \\
        --peer 'python -m bench.vllm_peer --engines {engines} --addr-file {addr_file}'

Needs `vllm.v1.engine.coordinator` importable (vLLM 0.33). Its process loop is
started unchanged on three fresh ipc addresses, and the endpoints it reports
once bound are written as an address file with the keys the harness reads
(`back_output`, `back_publish`, `front_publish`). SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from typing import Any


def _write_addresses(reader: Any, path: str) -> None:
    front_publish, back_output, back_publish = reader.recv()
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"front_publish": front_publish, "back_output": back_output,
                   "back_publish": back_publish}, handle)
    os.replace(tmp, path)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--addr-file", required=True)
    parser.add_argument("--dense", action="store_true", help="no wave coordination")
    args = parser.parse_args(argv)

    from vllm.v1.engine.coordinator import DPCoordinatorProc

    ipc_dir = tempfile.mkdtemp(prefix="bench-vllm-peer-")
    reader, writer = multiprocessing.Pipe(duplex=False)
    thread = threading.Thread(target=_write_addresses, args=(reader, args.addr_file),
                              daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        DPCoordinatorProc.run_coordinator(
            engine_count=args.engines,
            front_publish_address=f"ipc://{ipc_dir}/front_publish",
            back_output_address=f"ipc://{ipc_dir}/back_output",
            back_publish_address=f"ipc://{ipc_dir}/back_publish",
            zmq_addr_pipe=writer,
            enable_wave_coordination=not args.dense,
        )
    except KeyboardInterrupt:
        pass
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
