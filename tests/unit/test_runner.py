"""The order actions are carried out in (``core.runner``), which the server and the
tests' driver share: outcomes reach the core at once, its answers come after the
current actions, and a ``DispatchAdd``'s wake and reply follow only a sent ADD."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.core.actions import NO_ACTIONS, Action, DispatchAdd, Log, Publish, Send
from coordinator.core.events import Event, SendFailed, SendSucceeded
from coordinator.core.runner import ActionRunner


def log(text: str) -> Log:
    return Log(20, text, ())


class ScriptedCore:
    """Answers each outcome with the actions scripted for it, and records what it heard."""

    def __init__(self, answers: dict[str, Sequence[Action]]) -> None:
        self.answers = answers
        self.heard: list[Event] = []

    def handle(self, event: Event, now: float) -> Sequence[Action]:
        self.heard.append(event)
        assert isinstance(event, (SendFailed, SendSucceeded))
        key = event.action.reply.frames[0].decode() if isinstance(event.action, DispatchAdd) \
            else event.action.frames[0].decode()
        return self.answers.get(key, NO_ACTIONS)


class Carriers:
    """Carries out actions into one list, in order; sends to ``fail`` fail."""

    def __init__(self, fail: set[bytes] | None = None) -> None:
        self.fail = fail or set()
        self.done: list[str] = []

    def table(self) -> dict[type, Any]:
        return {Send: self.send, DispatchAdd: self.add, Log: self.log, Publish: self.publish}

    def send(self, action: Send) -> Event | None:
        if action.identity in self.fail:
            self.done.append(f"failed {action.frames[0].decode()}")
            return SendFailed(action, "unreachable")
        self.done.append(f"sent {action.frames[0].decode()}")
        return SendSucceeded(action) if action.confirm else None

    def add(self, action: DispatchAdd) -> Event | None:
        if action.engine in self.fail:
            self.done.append("ADD failed")
            return SendFailed(action, "unreachable")
        self.done.append(f"ADD to {action.rank}")
        return None

    def log(self, action: Log) -> None:
        self.done.append(action.message)

    def publish(self, action: Publish) -> None:
        self.done.append(f"published {action.frames[0].decode()}")


def add(rank: int, reply: str, *wake: Action) -> DispatchAdd:
    return DispatchAdd(rank, bytes([rank, 0]), [b"p"], Send("frontend", b"fe", (reply.encode(),)),
                       tuple(wake))


def test_actions_run_in_order_and_a_sent_adds_wake_and_reply_follow_it() -> None:
    carriers = Carriers()
    runner = ActionRunner(ScriptedCore({}), carriers.table(), lambda: 0.0)
    runner.run([log("first"), add(1, "submitted", Publish("back_publish", (b"wake",))),
                log("last")])
    assert carriers.done == ["first", "ADD to 1", "published wake", "sent submitted", "last"]


def test_a_failed_add_goes_back_at_once_and_its_wake_and_reply_do_not_run() -> None:
    core = ScriptedCore({"submitted": [log("answer to the failure")]})
    carriers = Carriers(fail={bytes([1, 0])})
    runner = ActionRunner(core, carriers.table(), lambda: 7.0)
    runner.run([add(1, "submitted", Publish("back_publish", (b"wake",))), log("next")])
    # The core heard of the failure before "next" ran; its answer comes after it.
    assert carriers.done == ["ADD failed", "next", "answer to the failure"]
    assert [type(e) for e in core.heard] == [SendFailed]


def test_answers_to_outcomes_run_after_the_current_actions_round_by_round() -> None:
    probe = Send("dispatch", b"e1", (b"probe",), confirm=True)
    core = ScriptedCore({"probe": [log("answer 1"), Send("frontend", b"x", (b"nested",),
                                                          confirm=True)],
                         "nested": [log("answer 2")]})
    carriers = Carriers()
    ActionRunner(core, carriers.table(), lambda: 0.0).run([probe, log("after probe")])
    assert carriers.done == ["sent probe", "after probe", "answer 1", "sent nested",
                             "answer 2"]


def test_the_server_and_the_driver_share_the_runner() -> None:
    import coordinator.server.app as app
    import tests.unit.core_driver as driver
    assert app.ActionRunner is ActionRunner and driver.ActionRunner is ActionRunner
