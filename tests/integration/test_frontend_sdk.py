"""FrontendClient against a real coordinator process and real engines, on ipc and tcp.

Engines are either `EngineAgent`s driven by the test (so the test decides what
load each rank reports and sees exactly which frames reach which rank) or a
`SimEngineGroup` of simulated lockstep engines (for full round trips and waves).
START_DP_WAVE broadcasts are observed with a raw XSUB on `back_publish`, the
way an engine sees them.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from coordinator.engine import AbortRequests, AddRequest, EngineAgent
from coordinator.frontend import FrontendClient, InvalidRequest, RegisterError, SubmitError
from coordinator.launch import CoordinatorHandle, launch
from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm
from coordinator.protocol.vllm import EngineCoreOutputs
from coordinator.sim import SimConfig, SimEngineGroup, SimRequest, encode_sim_request

pytestmark = pytest.mark.timeout(60)

STEP = 5.0  # bound on any single wait
TRANSPORTS = ["ipc", "tcp"]

# sun_path holds 108 bytes; leave room for the socket names.
_MAX_IPC_DIR = 80


# ---------------------------------------------------------------- fixtures


class Harness:
    """Starts coordinators, clients, agents and sim groups; tears all of them down."""

    def __init__(self, tmp_path: Path, transport: str) -> None:
        self.tmp_path = tmp_path
        self.transport = transport
        self.host = "127.0.0.1" if transport == "tcp" else None
        self.coordinators: list[CoordinatorHandle] = []
        self.clients: list[FrontendClient] = []
        self.agents: list[EngineAgent] = []
        self.groups: list[SimEngineGroup] = []
        self.scratch: list[str] = []
        self.ctx = zmq.asyncio.Context()
        self.raw: list[zmq.asyncio.Socket] = []

    def short_dir(self, name: str) -> str:
        path = self.tmp_path / name
        if len(str(path)) > _MAX_IPC_DIR:
            made = tempfile.mkdtemp(prefix="dpf-")
            self.scratch.append(made)
            return made
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def coordinator(self, engines: int, *, frontends: int = 0, lockstep: bool = True,
                    extra_args: tuple[str, ...] = ()) -> CoordinatorHandle:
        index = len(self.coordinators)
        args = list(extra_args)
        if self.host is None:
            args += ["--ipc-dir", self.short_dir(f"coord{index}")]
        handle = launch(
            engines=engines, frontends=frontends, host=self.host, lockstep=lockstep,
            addr_file=str(self.tmp_path / f"addresses{index}.json"), extra_args=args,
            timeout=20.0,
        )
        self.coordinators.append(handle)
        return handle

    def client(self, handle: CoordinatorHandle, client_index: int = 0,
               **kwargs: Any) -> FrontendClient:
        ipc_dir = None if self.host else self.short_dir(f"fe{len(self.clients)}")
        client = FrontendClient(handle.addresses, client_index=client_index, host=self.host,
                                ipc_dir=ipc_dir, call_timeout_s=STEP, **kwargs)
        self.clients.append(client)
        return client

    async def agents_for(self, handle: CoordinatorHandle, ranks: range) -> list[EngineAgent]:
        agents = [EngineAgent(handle.addresses["handshake"], rank, heartbeat_interval_s=0.5,
                              handshake_timeout_s=STEP * 2, ready_timeout_s=STEP * 2,
                              accept_timeout_s=STEP)
                  for rank in ranks]
        self.agents += agents
        await asyncio.wait_for(asyncio.gather(*(a.start() for a in agents)), STEP * 3)
        return agents

    async def sim_group(self, handle: CoordinatorHandle, engines: int) -> SimEngineGroup:
        group = SimEngineGroup(
            handle.addresses["handshake"], engines,
            config=SimConfig(step_time_s=0.002, collective_timeout_s=STEP,
                             heartbeat_interval_s=0.5),
            collective_address="tcp://127.0.0.1:0",
        )
        self.groups.append(group)
        await asyncio.wait_for(group.start(), STEP * 3)
        return group

    def raw_socket(self, kind: int, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self.raw.append(sock)
        return sock

    async def close(self) -> None:
        for client in self.clients:
            await asyncio.wait_for(client.close(), STEP)
        for group in self.groups:
            await asyncio.wait_for(group.stop(), STEP * 2)
        for agent in self.agents:
            await asyncio.wait_for(agent.close(linger_s=0.0), STEP)
        for sock in self.raw:
            sock.close(0)
        self.ctx.term()
        for handle in self.coordinators:
            died = handle.returncode
            code = handle.shutdown(timeout=5.0)
            if died is not None or code != 0:
                print(f"coordinator exit code {code}; stderr:\n{handle.stderr_text()[-4000:]}")
        for directory in self.scratch:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=TRANSPORTS)
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path, request.param)
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture
async def ipc_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path, "ipc")
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture
def short_tmp() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="dpf-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- helpers


def sim_payload(client: FrontendClient, request_id: str, steps: int = 3) -> list[bytes]:
    return [encode_sim_request(SimRequest(request_id, client.client_index, client.wave, steps,
                                          time.monotonic_ns()))]


async def next_add(agent: EngineAgent, timeout: float = STEP) -> AddRequest:
    deadline = time.monotonic() + timeout
    while True:
        item = await agent.recv_request(timeout_s=max(0.01, deadline - time.monotonic()))
        if isinstance(item, AddRequest):
            return item


async def next_abort(agent: EngineAgent, timeout: float = STEP) -> AbortRequests:
    deadline = time.monotonic() + timeout
    while True:
        item = await agent.recv_request(timeout_s=max(0.01, deadline - time.monotonic()))
        if isinstance(item, AbortRequests) and item.request_ids:
            return item  # empty ABORTs are the coordinator's liveness probes


def adds_queued(agent: EngineAgent) -> list[AddRequest]:
    found = []
    while (item := agent.get_request_nowait()) is not None:
        if isinstance(item, AddRequest):
            found.append(item)
    return found


async def wait_until(condition: Callable[[], bool], timeout: float = STEP,
                     what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def report(agent: EngineAgent, step: list[int], waiting: int, running: int = 0) -> None:
    step[0] += 1
    agent.send_stats(waiting=waiting, running=running, kv_cache_usage=0.0,
                     step_counter=step[0], current_wave=0)


# ---------------------------------------------------------------- round trips


async def test_register_submit_finish_round_trip(harness: Harness) -> None:
    handle = harness.coordinator(engines=2, frontends=1)
    client = harness.client(handle)
    registered = await client.register()
    assert (registered.client_index, registered.rank_start, registered.rank_count) == (0, 0, 2)
    assert registered.lockstep is True
    await harness.sim_group(handle, 2)
    await client.wait_for(lambda c: c.counts is not None, timeout=STEP)
    assert client.counts is not None and len(client.counts) == 2

    ids = [f"rt-{i}" for i in range(8)]
    submitted = await asyncio.gather(*(client.submit(rid, sim_payload(client, rid))
                                       for rid in ids))
    assert [s.request_id for s in submitted] == ids
    assert {s.rank for s in submitted} <= {0, 1}
    assert sum(s.woke for s in submitted) == 1  # the group was paused: one wake

    seen: dict[str, int] = {}
    async for item in client.finished(idle_timeout=STEP):
        seen[item.request_id] = item.engine_index
        if len(seen) == len(ids):
            break
    assert sorted(seen) == sorted(ids)
    # The finish came from the rank the coordinator said it chose.
    assert seen == {s.request_id: s.rank for s in submitted}
    assert client.in_flight == {}

    # Finished went back to the coordinator: its routing table is empty again.
    deadline = time.monotonic() + STEP
    while (state := await client.query_state()).in_flight:
        assert time.monotonic() < deadline, f"coordinator still routes {state.in_flight}"
        await asyncio.sleep(0.05)
    # And the group paused after the wave, which the client saw published.
    await client.wait_for(lambda c: c.wave >= 1 and not c.running, timeout=STEP)


async def test_least_loaded_choice_and_explicit_rank(harness: Harness) -> None:
    handle = harness.coordinator(engines=2, frontends=1, lockstep=False)
    client = harness.client(handle)
    await client.register()
    a0, a1 = await harness.agents_for(handle, range(2))
    steps = [[0], [0]]

    async def loads(w0: int, w1: int) -> None:
        await report(a0, steps[0], w0)
        await report(a1, steps[1], w1)
        await client.wait_for(
            lambda c: c.counts is not None and [r[0] for r in c.counts[:2]] == [w0, w1])

    await loads(50, 0)
    picks = [(await client.submit(f"ll-a{i}", [b"x"])).rank for i in range(4)]
    assert picks == [1, 1, 1, 1]
    assert len([await next_add(a1) for _ in range(4)]) == 4
    assert adds_queued(a0) == []

    await loads(0, 50)
    picks = [(await client.submit(f"ll-b{i}", [b"x"])).rank for i in range(4)]
    assert picks == [0, 0, 0, 0]

    # An explicit dp_rank wins over the balancer, payload frames arrive untouched.
    explicit = await client.submit("ll-explicit", [b"frame-1", b"frame-2"], dp_rank=1)
    assert explicit.rank == 1 and not explicit.woke
    add = await next_add(a1)
    assert add.frames == (b"frame-1", b"frame-2")


async def test_refusals_have_codes(harness: Harness) -> None:
    handle = harness.coordinator(engines=2, frontends=1, lockstep=False)
    client = harness.client(handle)
    await client.register()
    a0, _a1 = await harness.agents_for(handle, range(2))

    with pytest.raises(SubmitError) as out_of_range:
        await client.submit("r-range", [b"x"], dp_rank=2)
    assert out_of_range.value.code == fp.ERR_UNKNOWN_RANK
    assert out_of_range.value.request_id == "r-range"
    assert client.in_flight == {}

    first = await client.submit("r-dup", [b"x"], dp_rank=0)
    with pytest.raises(SubmitError) as duplicate:
        await client.submit("r-dup", [b"y"])
    assert duplicate.value.code == fp.ERR_DUPLICATE_REQUEST
    assert [add.frames for add in [await next_add(a0)]] == [(b"x",)]

    # Finished frees the routing entry, so the id may be used again.
    a0.send_output(0, EngineCoreOutputs(finished_requests=["r-dup"]))
    await wait_until(lambda: "r-dup" not in client.in_flight, what="finish of r-dup")
    deadline = time.monotonic() + STEP
    while True:
        try:
            again = await client.submit("r-dup", [b"z"])
            break
        except SubmitError as exc:  # the batched Finished may still be on its way
            assert exc.code == fp.ERR_DUPLICATE_REQUEST
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
    assert first.rank == 0 and again.rank in (0, 1)

    # Values outside the protocol's bounds are refused before anything is sent.
    for kwargs in ({"dp_rank": 70000}, {"wave": -1}):
        with pytest.raises(InvalidRequest):
            await client.submit("r-bounds", [b"x"], **kwargs)
    with pytest.raises(InvalidRequest):
        await client.submit("", [b"x"])
    with pytest.raises(ValueError):
        await client.submit("r-nopayload", [])
    assert client.notices_nowait() == []

    bad_client = harness.client(handle, client_index=5)
    with pytest.raises(RegisterError) as refused:
        await bad_client.register()
    assert refused.value.code == fp.ERR_BAD_CLIENT_INDEX


async def test_abort_goes_to_the_holder(ipc_harness: Harness) -> None:
    handle = ipc_harness.coordinator(engines=2, frontends=1, lockstep=False)
    client = ipc_harness.client(handle)
    await client.register()
    a0, a1 = await ipc_harness.agents_for(handle, range(2))
    await client.submit("ab-1", [b"x"], dp_rank=1)
    await client.submit("ab-0", [b"x"], dp_rank=0)
    await next_add(a1)
    await next_add(a0)
    routed = await client.abort(["ab-1", "never-submitted"])
    assert routed == ["ab-1"]
    abort = await next_abort(a1)
    assert abort.request_ids == ["ab-1"]
    assert "ab-1" not in client.in_flight and "ab-0" in client.in_flight
    # Rank 0 holds nothing that was aborted: it gets no ABORT naming a request.
    await asyncio.sleep(0.1)
    while (item := a0.get_request_nowait()) is not None:
        assert not (isinstance(item, AbortRequests) and item.request_ids), item


async def test_admin_drain_notice_and_cordon(ipc_harness: Harness) -> None:
    handle = ipc_harness.coordinator(engines=2, frontends=1, lockstep=False)
    client = ipc_harness.client(handle)
    await client.register()
    _a0, a1 = await ipc_harness.agents_for(handle, range(2))
    await client.submit("dr-1", [b"x"], dp_rank=1)
    done = await client.admin("drain", 1)
    assert (done.rank, done.state) == (1, "draining")
    with pytest.raises(SubmitError) as not_ready:
        await client.submit("dr-2", [b"x"], dp_rank=1)
    assert not_ready.value.code == fp.ERR_RANK_NOT_READY
    assert client.notices_nowait() == []  # still one request in flight on rank 1
    a1.send_output(0, EngineCoreOutputs(finished_requests=["dr-1"]))
    notices = []
    async for notice in client.notices(idle_timeout=STEP):
        notices.append(notice)
        break
    assert notices == [fp.RankDrained(1)]
    # Everything new goes to rank 0 now.
    assert (await client.submit("dr-3", [b"x"])).rank == 0
    assert (await client.admin("uncordon", 1)).state == "ready"


# ---------------------------------------------------------------- bad input


async def test_bad_frames_get_error_replies_and_service_continues(harness: Harness) -> None:
    handle = harness.coordinator(engines=2, frontends=1, lockstep=False)
    client = harness.client(handle)
    await client.register()
    await harness.agents_for(handle, range(2))
    raw = harness.raw_socket(zmq.DEALER, handle.addresses["frontend"])
    # Each bad frame with the call id the error reply must echo: the header's own id
    # when its first two elements are readable as [tag, id], else 0.
    garbage: list[tuple[list[bytes], int]] = [
        ([b"\xc1"], 0),                                                     # not msgpack
        ([b""], 0),                                                         # empty header
        ([msgspec.msgpack.encode(["no-such-kind", 1])], 1),                 # unknown tag
        ([msgspec.msgpack.encode(["submit", 2, "id", 0])], 2),              # no payload
        ([fp.encode(fp.QueryState(7)), b"extra"], 7),                       # payload where none
        ([msgspec.msgpack.encode(["submit", 3, "id", -1, None]), b"p"], 3),  # negative wave
        ([msgspec.msgpack.encode(["submit", 4, "", 0, None]), b"p"], 4),     # empty request id
        ([msgspec.msgpack.encode(["admin", 5, "reboot", 0])], 5),           # unknown command
        ([msgspec.msgpack.encode(["state"])], 0),                           # missing call id
    ]
    for frames, call_id in garbage:
        await asyncio.wait_for(raw.send_multipart(frames), STEP)
        reply = fp.decode_reply(await asyncio.wait_for(raw.recv(), STEP))
        assert isinstance(reply, fp.ErrorReply), frames
        assert (reply.call_id, reply.code) == (call_id, fp.ERR_BAD_FRAME), frames
        assert reply.message

    # The same raw socket and the SDK client are both still served.
    await asyncio.wait_for(raw.send_multipart([fp.encode(fp.QueryState(9))]), STEP)
    reply = fp.decode_reply(await asyncio.wait_for(raw.recv(), STEP))
    assert isinstance(reply, fp.StateReply) and reply.call_id == 9
    state = await client.query_state()
    dropped = sum(n for key, n in state.counters.items() if key.startswith("dropped.frontend"))
    assert dropped == len(garbage)
    assert (await client.submit("after-garbage", [b"x"])).rank in (0, 1)


async def test_state_query_shows_membership(ipc_harness: Harness) -> None:
    handle = ipc_harness.coordinator(engines=3, frontends=2, lockstep=True)
    clients = [ipc_harness.client(handle, i) for i in range(2)]
    await asyncio.gather(*(c.register() for c in clients))
    before = await clients[0].query_state()
    assert [e.state for e in before.engines] == ["absent"] * 3
    agents = await ipc_harness.agents_for(handle, range(3))
    state = await clients[1].query_state()
    assert (state.rank_start, state.rank_count, state.frontends) == (0, 3, 2)
    assert state.lockstep is True and state.wave == 0 and state.running is False
    assert [e.rank for e in state.engines] == [0, 1, 2]
    assert [e.state for e in state.engines] == ["ready"] * 3
    assert [e.engine_id for e in state.engines] == [a.engine_id for a in agents]
    # Concurrent calls on one client are matched to their own replies.
    many = await asyncio.gather(*(clients[0].query_state() for _ in range(20)),
                                clients[0].submit("st-1", [b"x"], dp_rank=2))
    assert all(isinstance(s, fp.GroupState) for s in many[:20])
    assert isinstance(many[20], fp.Submitted) and many[20].rank == 2
    assert (await clients[0].query_state()).engines[2].in_flight == 1


# ---------------------------------------------------------------- waves


async def _start_waves_seen(sub: zmq.asyncio.Socket) -> list[tuple[int, int | None]]:
    seen = []
    while True:
        try:
            frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return seen
        if frames[0] == vllm.START_DP_WAVE:
            seen.append(vllm.decode_start_dp_wave(frames))


async def test_concurrent_first_requests_wake_the_group_once(harness: Harness) -> None:
    handle = harness.coordinator(engines=2, frontends=4, lockstep=True)
    clients = [harness.client(handle, i) for i in range(4)]
    await asyncio.gather(*(c.register() for c in clients))
    await harness.sim_group(handle, 2)
    sub = harness.raw_socket(zmq.XSUB, handle.addresses["back_publish"])
    await sub.send(vllm.SUBSCRIBE)
    # A subscriber that arrives after start-up is sent READY: that says ours is live.
    assert await asyncio.wait_for(sub.recv_multipart(), STEP) == [vllm.READY]
    for c in clients:
        await c.wait_for(lambda c: c.counts is not None and not c.running)

    for round_ in range(2):
        wave = clients[0].wave
        assert all(c.wave == wave for c in clients)
        results = await asyncio.gather(*(
            c.submit(f"w{round_}-{c.client_index}", sim_payload(c, f"w{round_}-{i}", steps=4))
            for i, c in enumerate(clients)
        ))
        woke = [r for r in results if r.woke]
        assert len(woke) == 1, results
        # Every frontend sees the wave end: finishes arrived and the group paused.
        paused_after = wave + 1
        for c in clients:
            await c.wait_for(lambda c, w=paused_after: c.wave == w and not c.running)
            await wait_until(lambda c=c: not c.in_flight, what="finishes")
        await asyncio.sleep(0.1)
        starts = [s for s in await _start_waves_seen(sub) if s[0] == wave]
        assert len(starts) == 1, starts
        # The wake leaves out at most the engine that got the request.
        assert starts[0][1] in (None, woke[0].rank), starts
