"""Live output over HTTP: the answer's deltas as Server-Sent Events; a client that drops its
connection mid-answer and reconnects with `Last-Event-ID` misses nothing; a message posted with
`interrupt` cuts an answer in flight. Real `agents serve` and worker processes (tests/web/conftest.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, text
from tests.web.conftest import read_events, started

ANSWER = "In Paris it is sunny this morning and cloudy later, with a light west wind. " * 4


def streaming_agent(llm_server: LlmServer, *replies: Any) -> dict[str, Any]:
    return {"slug": "streamer", "model": f"openai/{llm_server.scenario(list(replies))}", "apiBase": llm_server.url}


def read_deltas(api: httpx.Client, sid: str, count: int) -> list[dict[str, Any]]:
    """Read the session's events until `count` text deltas came, then drop the connection."""
    seen: list[dict[str, Any]] = []
    with api.stream("GET", f"/v1/sessions/{sid}/events", timeout=httpx.Timeout(60)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
                if sum(e["type"] == "text_delta" for e in seen) >= count:
                    return seen  # leaving the block closes the connection mid-answer
    raise AssertionError(f"the stream ended before {count} deltas: {[e['type'] for e in seen]}")


def test_a_client_that_reconnects_with_last_event_id_misses_nothing(
    api: httpx.Client, llm_server: LlmServer, web_workers: Any
) -> None:
    agent = streaming_agent(llm_server, text(ANSWER, chunk_chars=2, chunk_delay=0.02))
    sid = started(api, agent, "Weather?", run="until_blocked")["session_id"]
    before = read_deltas(api, sid, 2)
    mark = before[-1]["id"]

    def more_written() -> bool:
        # More of the answer was written after the connection dropped (read from the start).
        with api.stream("GET", f"/v1/sessions/{sid}/events", params={"after": mark}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    return True
        return False

    wait_for(more_written, what="more of the answer after the drop")
    after = read_events(api, sid, until="completed", last_event_id=mark)
    events = before + after
    ids = [e["id"] for e in events]
    assert len(ids) == len(set(ids)), "nothing twice"
    deltas = [e for e in events if e["type"] == "text_delta"]
    assert [e["offset"] for e in deltas] == [sum(len(d["text"]) for d in deltas[:i]) for i in range(len(deltas))], (
        "no piece missed"
    )
    assert "".join(e["text"] for e in deltas) == ANSWER
    assert [e["type"] for e in after][-1] == "completed"
    assert api.get(f"/v1/sessions/{sid}").json()["response"] == ANSWER


def test_a_message_posted_with_interrupt_cuts_the_answer_in_flight(
    api: httpx.Client, llm_server: LlmServer, web_workers: Any
) -> None:
    agent = streaming_agent(llm_server, text("word " * 300, chunk_chars=3, chunk_delay=0.02), text("Berlin: rain."))
    sid = started(api, agent, "Paris?", run="until_blocked")["session_id"]
    read_deltas(api, sid, 1)
    posted = api.post(f"/v1/sessions/{sid}/messages", json={"prompt": "Berlin instead.", "interrupt": True})
    assert posted.status_code == 200, posted.text
    assert posted.json()["sent"] == "queued"
    events = read_events(api, sid, until="completed")
    assert "model_interrupted" in [e["type"] for e in events]
    shown = api.get(f"/v1/sessions/{sid}", params={"detail": "true"}).json()
    assert [t["kind"] for t in shown["turns"]] == ["UserTurn", "UserTurn", "LlmTurn"]
    assert shown["response"] == "Berlin: rain."
