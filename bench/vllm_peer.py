"""Run vLLM 0.33's own DP coordinator, unmodified, as a benchmark peer.

    python -m bench --peer vllm                      # what `make bench` does
    python -m bench.vllm_peer --engines 8 --addr-file /tmp/vllm.json

`vllm/v1/engine/coordinator.py` and the modules on its message path (the
`EngineCoreOutputs`/`SchedulerStats` structs and their msgpack decoder,
`make_zmq_socket`, logging) run from the pinned vLLM 0.33.0 wheel's own
source, through `tools.vllm_wheel`; torch, numpy, the config tree and the
rest of vLLM are stubbed. `DPCoordinatorProc.run_coordinator` is called as
vLLM's `DPCoordinator` calls it in its own process, on three fresh ipc
addresses, and the endpoints it reports once bound are written as an
address file with the keys the harness reads (`back_output`,
`back_publish`, `front_publish`). SIGTERM ends it.

The wheel must already be in the cache (`python -m tools.vllm_wheel fetch`;
`python -m bench --peer vllm` fetches it before starting anything), so a
timed start-up never waits for a download.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading

COORDINATOR_MODULE = "vllm.v1.engine.coordinator"


def _write_addresses(reader: multiprocessing.connection.Connection, path: str) -> None:
    front_publish, back_output, back_publish = reader.recv()
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"front_publish": front_publish, "back_output": back_output,
                   "back_publish": back_publish}, handle)
    os.replace(tmp, path)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--addr-file", required=True)
    parser.add_argument("--dense", action="store_true", help="no wave coordination")
    parser.add_argument("--cache", default=None, help="vLLM wheel cache (default: "
                        "tools.vllm_wheel's)")
    args = parser.parse_args(argv)

    from tools import vllm_wheel

    try:
        vllm_wheel.install(cache=args.cache, download=False)
        import importlib

        coordinator = importlib.import_module(COORDINATOR_MODULE)
    except vllm_wheel.WheelUnavailable as exc:
        print(f"vllm peer: {exc}", file=sys.stderr)
        return 2
    print(f"vllm peer: {COORDINATOR_MODULE} from {coordinator.__file__}", file=sys.stderr,
          flush=True)

    ipc_dir = tempfile.mkdtemp(prefix="bench-vllm-peer-")
    reader, writer = multiprocessing.Pipe(duplex=False)
    thread = threading.Thread(target=_write_addresses, args=(reader, args.addr_file),
                              daemon=True)
    thread.start()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        coordinator.DPCoordinatorProc.run_coordinator(
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
    # vLLM's sockets close with the default linger (forever), so a normal
    # interpreter exit can wait without end on its ZMQ context for messages to
    # engines that are gone; nothing is left to flush, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
