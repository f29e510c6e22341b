"""The server's side of the core's contract, on real sockets: outcomes of sends go back.

One ``CoordinatorServer`` is bound in this process on private ipc paths, with a
clock the test moves; raw DEALER sockets play engines and a frontend. Frames are
read off the server's sockets and handed to its own frame handlers, and the
timer is ticked by hand, so every step is deterministic and bounded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import zmq

from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.server.app import CoordinatorServer
from coordinator.server.config import ServerConfig

pytestmark = pytest.mark.timeout(60)

STEP_S = 5.0
encoder = msgspec.msgpack.Encoder()


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    server: CoordinatorServer
    clock: Clock
    ctx: zmq.Context[zmq.Socket[bytes]]
    engines: dict[int, zmq.Socket[bytes]]
    frontend: zmq.Socket[bytes]

    def pump(self, key: str, count: int = 1) -> None:
        """Read ``count`` messages off the server's ``key`` socket into its handler."""
        sock = self.server.sock(key)
        for _ in range(count):
            assert sock.poll(int(STEP_S * 1000)), f"nothing arrived on {key}"
            self.server.frame_handlers[key](sock.recv_multipart())

    def reply(self) -> fp.FrontendReply:
        assert self.frontend.poll(int(STEP_S * 1000)), "no reply"
        return fp.decode_reply(self.frontend.recv())

    def connect_engine(self, rank: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.addresses["dispatch"])
        sock.send(b"greeting")
        self.engines[rank] = sock
        self.pump("dispatch")

    def tick(self, advance: float) -> None:
        self.clock.now += advance
        self.server._timer.tick()

    def state(self) -> fp.GroupState:
        self.frontend.send(fp.encode(fp.QueryState(99)))
        self.pump("frontend")
        reply = self.reply()
        assert isinstance(reply, fp.StateReply)
        return reply.state


def handshake(server: CoordinatorServer, rank: int) -> None:
    """HELLO and READY through the handshake handler (the replies go nowhere)."""
    identity = rank.to_bytes(2, "little")
    for status in ("HELLO", "READY"):
        server.frame_handlers["handshake"](
            [identity, encoder.encode({"status": status, "local": True, "headless": True})])


@pytest.fixture
def rig(tmp_path: os.PathLike[str]) -> Iterator[Rig]:
    clock = Clock()
    config = ServerConfig(engines=2, ipc_dir=os.path.join(tmp_path, "ipc"), lease_ttl_s=3.0,
                          state_file=os.path.join(tmp_path, "state", "state.json"))
    os.makedirs(os.path.join(tmp_path, "state"))
    server = CoordinatorServer(config, clock=clock)
    server.bind()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    frontend = ctx.socket(zmq.DEALER)
    frontend.setsockopt(zmq.IDENTITY, b"\x00frontend")
    frontend.setsockopt(zmq.LINGER, 0)
    frontend.connect(server.addresses["frontend"])
    rig = Rig(server, clock, ctx, {}, frontend)
    try:
        for rank in (0, 1):
            handshake(server, rank)
            rig.connect_engine(rank)
        for _ in (0, 1):
            server.frame_handlers["back_publish"]([vllm.SUBSCRIBE])
        frontend.send(fp.encode(fp.Register(1, 0, "ipc:///unused-output")))
        rig.pump("frontend")
        assert isinstance(rig.reply(), fp.Registered)
        yield rig
    finally:
        for sock in [*rig.engines.values(), frontend]:
            sock.close(0)
        ctx.term()
        server.close()


def close_engine(rig: Rig, rank: int) -> None:
    """The engine's process is gone: its dispatch connection closes."""
    rig.engines.pop(rank).close(0)
    deadline = time.monotonic() + STEP_S
    probe = [rank.to_bytes(2, "little"), vllm.ABORT, vllm.encode_abort([])]
    # Wait until libzmq has noticed (a send to the identity fails), without telling
    # the coordinator anything.
    while time.monotonic() < deadline:
        try:
            rig.server.sock("dispatch").send_multipart(probe, zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        time.sleep(0.01)
    raise AssertionError(f"dp_rank={rank}'s connection never went away")


def test_a_submit_whose_rank_is_gone_goes_to_the_next_one_on_real_sockets(rig: Rig) -> None:
    close_engine(rig, 0)
    for request in range(3):  # the first tie goes to rank 0, which is tried and found gone
        rig.frontend.send_multipart([fp.encode(fp.Submit(10 + request, f"r{request}", 0)),
                                     b"payload"])
        rig.pump("frontend")
        reply = rig.reply()
        assert isinstance(reply, fp.Submitted) and reply.rank == 1, reply
        assert rig.engines[1].poll(int(STEP_S * 1000))
        assert rig.engines[1].recv_multipart() == [vllm.ADD, b"payload"]
    assert not rig.frontend.poll(100)  # each submit was answered once
    state = rig.state()
    assert state.in_flight == 3 and state.engines[0].in_flight == 0
    assert state.counters["send_dropped.dispatch.unreachable"] >= 1


def test_a_failed_probe_kills_the_rank_and_fails_its_requests_to_their_frontend(rig: Rig) -> None:
    rig.frontend.send_multipart([fp.encode(fp.Submit(5, "on-0", 0, 0)), b"payload"])
    rig.pump("frontend")
    assert isinstance(rig.reply(), fp.Submitted)
    close_engine(rig, 0)
    for _ in range(6):  # the timer runs on time (a late tick would be a pause of our own)
        rig.tick(0.25)  # quiet for more than a third of the TTL by 1.5 s: probed
    notice = rig.reply()
    assert isinstance(notice, fp.RequestsFailed)
    assert notice.request_ids == ["on-0"] and notice.rank == 0
    lost = rig.reply()  # then every registered frontend hears of the rank
    assert isinstance(lost, fp.RankLost) and lost.rank == 0
    state = rig.state()
    assert [engine.state for engine in state.engines] == ["dead", "ready"]


def test_a_state_file_that_cannot_be_written_is_counted_and_retried(rig: Rig) -> None:
    path = rig.server.config.state_file
    assert path is not None
    directory = os.path.dirname(path)
    os.rename(directory, directory + ".away")  # writes there fail now
    try:
        rig.server.frame_handlers["back_output"](
            [vllm.encode_engine_outputs(vllm.EngineCoreOutputs(engine_index=1, start_wave=0))])
        assert rig.state().counters["state_file.write_errors"] == 1
        assert not os.path.exists(path)
    finally:
        os.rename(directory + ".away", directory)
    rig.tick(1.1)  # the retry a second later succeeds
    with open(path, "rb") as handle:
        saved = msgspec.json.decode(handle.read())
    assert saved["gate_open"] and saved["wave"] == 0
