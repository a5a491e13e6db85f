"""What Flower and `celery events` show of our tasks: their names, and arguments that say what they are."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery_agents.model import TrackedCall
from celery_agents.tasks.config import CALL_TASK, ISOLATED_TASK, STEP_TASK, Dispatcher


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.conf = SimpleNamespace(broker_url="redis://127.0.0.1:6379/0")

    def send_task(self, name: str, **options: Any) -> None:
        self.sent.append((name, options))


def test_a_step_message_names_its_session_version_and_why() -> None:
    app = Recorder()
    Dispatcher(app).step("s1", 4, "wake")  # type: ignore[arg-type]
    ((name, options),) = app.sent
    assert name == STEP_TASK and options["args"] == ("s1", 4, "wake")
    assert options["argsrepr"] == "session=s1 version=4 request=wake"


def test_a_call_message_names_its_tool_and_disposition_quoted() -> None:
    app = Recorder()
    for disposition in ("runAsync", "runIsolated"):
        call = TrackedCall(call_id="call_1", tool="get<b>x</b>", batch=1, position=2, disposition=disposition)
        Dispatcher(app).call("s1", call)  # type: ignore[arg-type]
    (async_name, async_options), (isolated_name, _) = app.sent
    assert (async_name, isolated_name) == (CALL_TASK, ISOLATED_TASK)
    assert async_options["args"] == ("s1", "1:2")
    assert async_options["argsrepr"] == "session=s1 call=1:2 tool='get<b>x</b>' runAsync id='call_1'"
