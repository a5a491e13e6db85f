"""`agents doctor` where no worker runs (the embedded default): a session a completion woke waits
for `agents session resume`, which doctor says, naming it, instead of failing."""

from __future__ import annotations

import dataclasses

from bench.harness import DEFER_AGENT
from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.tools.resolve import parse_agent


def owed_check(report: dict[str, object]) -> dict[str, object]:
    (found,) = [c for c in report["checks"] if c["name"] == "owed steps"]  # type: ignore[attr-defined]
    return found  # type: ignore[no-any-return]


def test_a_woken_session_with_no_worker_to_run_it_is_a_warning_that_says_how_to_go_on(settings: Settings) -> None:
    settings = dataclasses.replace(settings, owed_grace=0.0)
    with Client(settings, inline=True) as client:
        view = client.start(parse_agent(DEFER_AGENT), "Please book a table in Paris.", run=True)
        assert view.state.value == "waiting"
        (pending,) = client.pending(view.session_id)
        assert pending.token is not None
        assert client.complete(pending.token, {"booked": True}).woken
        found = owed_check(client.doctor())
        assert found["severity"] == "warning" and "fails_doctor" not in found, found
        assert view.session_id in str(found["detail"]) and "agents session resume ID" in str(found["detail"])
        assert client.resume(view.session_id).state.value == "completed"
        assert owed_check(client.doctor())["ok"]
    with Client(settings, inline=False) as queued:  # workers expected, none alive: an error
        view = queued.start(parse_agent(DEFER_AGENT), "Please book a table in Paris.", run=True, wait=False)
        found = owed_check(queued.doctor())
        assert found["severity"] == "error" and found["fails_doctor"], found
