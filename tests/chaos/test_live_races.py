"""Live output under faults: a worker SIGKILLed while the answer streams leaves no partial answer
in the transcript and the step runs again; an interrupting message sent at each named checkpoint
of a step (taken from the queue, before the model call, after the answer and before the commit)
reaches the next model call, and nothing is lost or duplicated."""

from __future__ import annotations

from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from tests.chaos.conftest import Fleet, report
from tests.chaos.invariants import check_invariants
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, Reply, text

pytestmark = pytest.mark.slow

ANSWER = "Paris today: sunny morning, clouds by four, a mild evening. " * 4


def agent(scenario: str, url: str) -> dict[str, Any]:
    return {"slug": "live-chaos", "model": f"openai/{scenario}", "apiBase": url}


def test_a_worker_killed_mid_stream_leaves_no_partial_answer_and_the_step_runs_again(
    fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    # The same answer every time, streamed over ~2.4 s.
    scenario = llm_server.scenario([text(ANSWER, chunk_chars=2, chunk_delay=0.02)])
    path = write_agent(agent(scenario, llm_server.url))
    doomed = fleet.start(AGENTS_STREAM_FLUSH_MS="50")
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "Weather?", run=True, wait=False, watch=True).session_id
        wait_for(lambda: sum(e["type"] == "text_delta" for e in client.events(sid)) >= 3, what="the answer to stream")
        doomed.kill()
        assert [t.kind for t in store.turns(sid)] == ["UserTurn"], "nothing of the answer is in the transcript"
        fleet.start(AGENTS_STREAM_FLUSH_MS="50")
        wait_for(lambda: store.header(sid).status.value != "active", timeout=90, what="a fresh worker to finish")
        check_invariants(store, sid)
        turns = store.turns(sid)
        assert [t.kind for t in turns] == ["UserTurn", "LlmTurn"]
        assert turns[-1].text == ANSWER, "the whole answer, once"
        assert llm_server.count(scenario) == 2, "the step ran again"
        left = [e for e in client.events(sid) if e["type"] == "text_delta"]
        # The second attempt's deltas went with its commit; what the killed one wrote starts at
        # offset 0 and is a piece of the answer a reader drops when the step starts again.
        assert left and left[0]["offset"] == 0
        assert ANSWER.startswith("".join(e["text"] for e in left))
        report("killed_mid_stream", deltas_left=len(left))


def _conversation() -> Any:
    """The first request answers slowly; one that carries the message answers at once."""

    def reply(body: dict[str, Any]) -> Reply:
        said = [m["content"] for m in body["messages"] if m["role"] == "user"]
        if "Berlin instead." in said:
            return text("Berlin: rain.")
        return text("Paris: sun.", chunk_chars=2, chunk_delay=0.02)

    return reply


# checkpoint: (the model requests made, the turns the session ends with)
RACES = {
    # before the step read the queue: the message is simply part of this step's model call
    "step_taken": (1, ["UserTurn", "UserTurn", "LlmTurn"]),
    # the queue read, the model not asked yet: the call is not made; the next step's takes it
    "before_llm": (1, ["UserTurn", "UserTurn", "LlmTurn"]),
    # the answer is in, not committed: it commits, and the message goes to the next model call
    "after_llm": (2, ["UserTurn", "LlmTurn", "UserTurn", "LlmTurn"]),
}


@pytest.mark.parametrize("where", list(RACES))
def test_an_interrupting_message_at_each_checkpoint_reaches_the_next_model_call(
    where: str, fleet: Fleet, chaos_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    requests, kinds = RACES[where]
    scenario = llm_server.scenario([_conversation()])
    path = write_agent(agent(scenario, llm_server.url))
    fleet.start(AGENTS_FAULT_PAUSE=where, AGENTS_FAULT_PAUSE_SECONDS="1.5")
    with Client(chaos_settings, inline=False) as client:
        store = client.store
        sid = client.start(path, "Weather in Paris?", run=True, wait=False).session_id
        wait_for(lambda: store.client.get(store.keys.fault(where)) == sid, what=f"checkpoint {where}")
        sent = client.send(sid, "Berlin instead.", interrupt=True)
        assert sent.sent == "queued"
        wait_for(lambda: store.header(sid).state == State.COMPLETED, timeout=60, what="the session to complete")
        check_invariants(store, sid)
        turns = store.turns(sid)
        assert [t.kind for t in turns] == kinds
        assert turns[-1].text == "Berlin: rain."
        asked = llm_server.requests[scenario]
        assert len(asked) == requests
        last_users = [m["content"] for m in asked[-1]["messages"] if m["role"] == "user"]
        assert last_users == ["Weather in Paris?", "Berlin instead."]
        assert client.view(sid).queued == []
        report(f"interrupt_at_{where}", model_requests=len(asked))
