"""A frontend whose outputs no engine can deliver is told so, not black-holed.

Without ``--frontends``, engines' INITs go out as soon as they say HELLO, with
the output addresses registered by then. A frontend that registers later is
not in them: those engines have no socket for its client index, and every
request sent there would finish without its outputs ever reaching it. The
coordinator knows both facts: its registration reply names the ranks, its
submits are refused ``undeliverable`` with the remedy, and that is counted and
logged. One that registered first is served as usual.
"""

from __future__ import annotations

from typing import Any

from tests.conftest import CoordinatorFactory
from tests.vllm_peers import RawFrontend, handshake_group, wait_until


def test_a_frontend_registered_after_the_inits_is_refused_with_the_remedy(
    coordinator: CoordinatorFactory, zmq_ctx: Any, tmp_path: Any
) -> None:
    handle = coordinator(2)
    early = RawFrontend(zmq_ctx, handle.addresses)
    registered = early.register(0, f"ipc://{tmp_path}/early")
    assert registered[0] == "registered" and registered[8] == [], registered
    engines = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    late = RawFrontend(zmq_ctx, handle.addresses)
    registered = late.register(1, f"ipc://{tmp_path}/late")
    assert registered[0] == "registered" and registered[8] == [0, 1], registered
    refused = late.submit("late-1", b"payload")
    assert refused[:2] == ["error", refused[1]] and refused[2] == "undeliverable", refused
    assert "--frontends N" in refused[3] and "dp_ranks 0, 1" in refused[3]
    served = early.submit("early-1", b"payload")
    assert served[0] == "submitted" and served[3] in (0, 1), served
    counters = early.counters()
    assert counters["submit.refused.undeliverable"] == 1
    assert counters["frontend.undeliverable"] == 1
    wait_until(lambda: "refused submits from frontend" in handle.stderr_text(),
               timeout=10.0, what="the refusal logged")
    assert "registered after dp_ranks 0, 1 got their INITs" in handle.stderr_text()
    for engine in engines:
        engine.close()
    early.close()
    late.close()


async def test_the_sdk_warns_at_registration_and_raises_the_refusal(
    coordinator: CoordinatorFactory, zmq_ctx: Any, caplog: Any
) -> None:
    import logging

    import pytest

    from coordinator.frontend import FrontendClient, SubmitError

    handle = coordinator(2)
    engines = handshake_group(zmq_ctx, handle.addresses, [0, 1], dp_size=2)
    async with FrontendClient(handle.addresses, client_index=0, call_timeout_s=10.0) as client:
        with caplog.at_level(logging.WARNING, logger="coordinator.frontend"):
            registered = await client.register()
        assert registered.undeliverable_ranks == [0, 1]
        assert "dp_rank 0, 1 went out without its output address" in caplog.text
        with pytest.raises(SubmitError) as refused:
            await client.submit("late", [b"payload"])
        assert refused.value.code == "undeliverable"
    for engine in engines:
        engine.close()
