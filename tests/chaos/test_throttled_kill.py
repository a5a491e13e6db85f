"""A worker SIGKILLed while it holds the countdowns of steps a fleet limit put back: nothing is
lost. The steps stay owed from their start times; another worker's sweeper publishes them again
once those have passed, and each session's model call is made once. The workers read the limits
at every model call (AGENTS_LIMITS_REFRESH=0), so the limit holds from the first session on."""

from __future__ import annotations

import datetime
import time

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from celery_agents.model.admission import ModelLimit
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, text

pytestmark = pytest.mark.slow

REFRESH = "0"


def test_steps_waiting_on_a_dead_workers_countdowns_go_on_elsewhere(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: object
) -> None:
    model = llm_server.scenario([text("done")])
    path = write_agent({"slug": "limited", "model": f"openai/{model}", "apiBase": llm_server.url})  # type: ignore[operator]
    doomed = fleet.start(AGENTS_LIMITS_REFRESH=REFRESH)
    with Client(chaos_settings, inline=False) as client:
        client.set_limit(f"openai/{model}", rpm=20)  # a call every 3 s
        sids = [client.start(path, f"go {i}", run=True, wait=False).session_id for i in range(4)]
        waiting = wait_for(
            lambda: len(put_back := [s for s in sids if client.view(s).throttled_until]) == 3 and put_back,
            timeout=30,
            what="three sessions put back, their countdowns held by the worker",
        )
        first_start = min(client.view(s).throttled_until or "" for s in waiting)
        # The one admitted at once has committed: a kill in its call would ask the model again.
        (admitted,) = [s for s in sids if s not in waiting]
        wait_for(lambda: client.view(admitted).state == State.COMPLETED, timeout=30, what="the admitted session")
        doomed.kill()
        killed_at = time.monotonic()
        # Killed before any of them was due, the dead worker made none of their calls.
        early = datetime.datetime.now(datetime.UTC) < datetime.datetime.fromisoformat(first_start)
        fleet.start(AGENTS_LIMITS_REFRESH=REFRESH)
        wait_for(
            lambda: all(client.view(s).state == State.COMPLETED for s in sids),
            timeout=60,
            what="every session to complete on the other worker",
        )
        took = time.monotonic() - killed_at
        for sid in sids:
            check_invariants(client.store, sid)
        assert client.store.limit_usages()[0].limit == ModelLimit(rpm=20)
    if early:
        assert llm_server.count(model) == 4, "each session's model call was made once"
    else:  # a loaded machine: the worker may have died in a call, which is asked once more
        assert llm_server.count(model) <= 5
    report("throttled kill", put_back=len(waiting), recovered_in_s=round(took, 1))
