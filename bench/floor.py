"""The floor: the same six sockets as the coordinator, forwarding with no logic.

    python -m bench.floor --mode wake --engines 64 --addr-file /tmp/floor.json

Whatever the coordinator does per message costs at least a receive and a
send through pyzmq and libzmq; this process does only that, so our/floor
says how much the coordinator's own work adds. Per mode:

  wake           back_output PULL -> back_publish XPUB ([b"\\x02", frame])
  first_request  frontend ROUTER -> dispatch ROUTER (ADD to the next engine in
                 turn) + back_publish XPUB (START_DP_WAVE) + a reply;
                 back_output PULL -> front_publish XPUB (raw)
  dispatch       frontend ROUTER -> dispatch ROUTER (ADD to the next engine in
                 turn) + a reply; messages without payload are dropped
  stats          back_output PULL, counted and dropped; every 100 ms a
                 publish `[[[count, 0, 0.0]], 0, false]` on front_publish
  handshake      a fixed INIT for HELLO, ACCEPTED for READY

Every mode also runs vLLM's start-up gate (READY on back_publish once
`--engines` subscriptions arrived), so the same drivers work unchanged. The
loop is one `zmq.Poller` with NOBLOCK draining, like the coordinator's
readers, and stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time

import msgspec
import zmq

import coordinator.protocol.vllm as vllm
from bench.wire import FLOOR_SUBMITTED

MODES = ("wake", "first_request", "dispatch", "stats", "handshake")
KEYS = ("handshake", "dispatch", "back_output", "back_publish", "front_publish", "frontend")
PUBLISH_INTERVAL_S = 0.1


def write_addresses(path: str, addresses: dict[str, str]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(addresses, handle)
    os.replace(tmp, path)


def serve(mode: str, engines: int, addr_file: str, coalesce_ms: float = 0.0) -> None:
    ipc_dir = tempfile.mkdtemp(prefix="bench-floor-")
    ctx = zmq.Context()
    kinds = {
        "handshake": zmq.ROUTER,
        "dispatch": zmq.ROUTER,
        "back_output": zmq.PULL,
        "back_publish": zmq.XPUB,
        "front_publish": zmq.XPUB,
        "frontend": zmq.ROUTER,
    }
    socks: dict[str, zmq.Socket[bytes]] = {}
    addresses: dict[str, str] = {}
    for key in KEYS:
        sock = ctx.socket(kinds[key])
        sock.setsockopt(zmq.LINGER, 0)
        if key in ("back_publish", "front_publish"):
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        if key == "back_output":
            sock.setsockopt(zmq.RCVHWM, 0)
        if key == "dispatch":
            sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(f"ipc://{os.path.join(ipc_dir, key)}")
        socks[key] = sock
        addresses[key] = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    init_reply = vllm.encode_init(
        vllm.EngineHandshakeMetadata(
            addresses=vllm.EngineZmqAddresses(
                inputs=[addresses["dispatch"]],
                outputs=[],
                coordinator_input=addresses["back_publish"],
                coordinator_output=addresses["back_output"],
                frontend_stats_publish_address=addresses["front_publish"],
            ),
            parallel_config={},
        )
    )
    accepted = vllm.encode_handshake_accepted()
    start_frames_header = vllm.START_DP_WAVE
    engine_ids = [rank.to_bytes(2, "little") for rank in range(engines)]
    encoder = msgspec.msgpack.Encoder()

    stop = False

    def request_stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    write_addresses(addr_file, addresses)

    poller = zmq.Poller()
    for sock in socks.values():
        poller.register(sock, zmq.POLLIN)
    handshake = socks["handshake"]
    dispatch = socks["dispatch"]
    back_output = socks["back_output"]
    back_publish = socks["back_publish"]
    front_publish = socks["front_publish"]
    frontend = socks["frontend"]
    subscriptions = 0
    gate_open = False
    next_engine = 0
    received = 0
    next_publish = time.monotonic() + PUBLISH_INTERVAL_S
    noblock = zmq.NOBLOCK
    again = zmq.Again
    coalesce_s = coalesce_ms / 1000.0

    try:
        while not stop:
            timeout_ms = 100
            if mode == "stats":
                timeout_ms = max(0, int((next_publish - time.monotonic()) * 1000) + 1)
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                continue  # interrupted by a signal
            if back_output in events:
                for _ in range(4096):
                    try:
                        frame = back_output.recv(noblock)
                    except again:
                        break
                    if mode == "wake":
                        back_publish.send_multipart([start_frames_header, frame], noblock)
                    elif mode == "first_request":
                        front_publish.send(frame, noblock)
                    else:
                        received += 1
            if frontend in events:
                for _ in range(4096):
                    try:
                        frames = frontend.recv_multipart(noblock)
                    except again:
                        break
                    if len(frames) != 3:
                        continue
                    peer, header, payload = frames
                    dispatch.send_multipart(
                        [engine_ids[next_engine], vllm.ADD, payload], noblock
                    )
                    next_engine = (next_engine + 1) % engines
                    if mode == "first_request":
                        back_publish.send_multipart([start_frames_header, header], noblock)
                    frontend.send_multipart([peer, FLOOR_SUBMITTED], noblock)
            if dispatch in events:
                for _ in range(4096):
                    try:
                        dispatch.recv_multipart(noblock)
                    except again:
                        break
            if handshake in events:
                for _ in range(4096):
                    try:
                        peer, payload = handshake.recv_multipart(noblock)
                    except again:
                        break
                    except ValueError:
                        continue
                    reply = init_reply if b"HELLO" in payload else accepted
                    handshake.send_multipart([peer, reply], noblock)
            if back_publish in events:
                for _ in range(4096):
                    try:
                        frame = back_publish.recv(noblock)
                    except again:
                        break
                    if frame == vllm.SUBSCRIBE:
                        subscriptions += 1
                        if gate_open or subscriptions >= engines:
                            gate_open = True
                            back_publish.send(vllm.READY, noblock)
            if front_publish in events:
                for _ in range(4096):
                    try:
                        front_publish.recv(noblock)
                    except again:
                        break
            if coalesce_s:
                # Let input gather: one wake-up per interval instead of one per burst.
                time.sleep(coalesce_s)
            if mode == "stats" and gate_open:
                now = time.monotonic()
                if now >= next_publish:
                    front_publish.send(
                        encoder.encode(([(received & 0x7FFFFFFF, 0, 0.0)], 0, False)), noblock
                    )
                    next_publish += PUBLISH_INTERVAL_S
                    if next_publish < now:
                        next_publish = now + PUBLISH_INTERVAL_S
    finally:
        for sock in socks.values():
            sock.close(0)
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(addr_file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--addr-file", required=True)
    parser.add_argument("--coalesce-ms", type=float, default=0.0,
                        help="sleep this long after each round of draining (default 0: "
                        "handle input as soon as it arrives)")
    args = parser.parse_args(argv)
    serve(args.mode, args.engines, args.addr_file, args.coalesce_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
