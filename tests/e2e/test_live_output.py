"""Live output on real worker processes, a real Redis and the scripted model server streaming
slowly: the answer's deltas arrive before the commit and join into the answer, then leave the
stream; the transcript is the same streamed or not; `send --interrupt` during a slow answer drops
it and the next model request carries the message; `agents run`, `session resume` and `session
step` on a terminal print the answer as it streams, once; the offline `test/tools` model calls
tools of different schemas with valid arguments. The workers are shared by the module."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import DELTA_EVENTS, State
from tests.cli.process import CLI, agents, cli_env
from tests.e2e.conftest import record_tool, runs, start_workers, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.workers import Worker, stop_all

pytestmark = pytest.mark.slow

ANSWER = "The weather in Paris is sunny, with a light breeze from the west and 21 degrees by noon."


@pytest.fixture(scope="module")
def live_workers(
    redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    logdir = tmp_path_factory.mktemp("logs")
    ws = start_workers(redis_url, module_prefix, logdir, count=1, concurrency=2, AGENTS_STREAM_FLUSH_MS="100")
    yield ws
    stop_all(ws)


@pytest.fixture
def client(live_workers: Any, module_settings: Settings) -> Iterator[Client]:
    with Client(module_settings) as c:
        yield c


def agent(scenario: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"slug": "live", "model": f"openai/{scenario}", "apiBase": url, **extra}


def slow(content: str, **kw: Any) -> Reply:
    """An answer streamed 3 characters at a time, 20 ms apart."""
    return text(content, chunk_chars=3, chunk_delay=0.02, **kw)


def follow(client: Client, sid: str, out: list[dict[str, Any]]) -> threading.Thread:
    """Read the session's events as they come, on a thread, until it ends."""

    def read() -> None:
        for e in client.events(sid, follow=True):
            out.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def test_the_answer_streams_as_deltas_before_its_commit_and_they_join_into_it(
    client: Client, llm_server: LlmServer, write_agent: Any
) -> None:
    scenario = llm_server.scenario([slow(ANSWER, reasoning="Thinking about Paris.")])
    sid = client.start(write_agent(agent(scenario, llm_server.url)), "Weather in Paris?").session_id
    seen: list[dict[str, Any]] = []
    reader = follow(client, sid, seen)
    view = client.step(sid, timeout=60)
    reader.join(30)
    assert view.state == State.COMPLETED and view.response == ANSWER
    types = [e["type"] for e in seen]
    committed = types.index("llm_called")  # the first event of the step's commit
    text_deltas = [e for e in seen if e["type"] == "text_delta"]
    assert len(text_deltas) >= 3, "a ~1.8 s answer comes in several batches"
    assert len(text_deltas) < len(ANSWER) / 3 / 3, "batched: far fewer writes than chunks"
    assert max(seen.index(e) for e in text_deltas) < committed, "every delta came before the commit"
    assert "".join(e["text"] for e in text_deltas) == ANSWER
    assert [e["offset"] for e in text_deltas] == [
        sum(len(d["text"]) for d in text_deltas[:i]) for i in range(len(text_deltas))
    ]
    assert "".join(e["text"] for e in seen if e["type"] == "reasoning_delta") == "Thinking about Paris."
    # Once committed, the deltas are gone from the stream: it holds the transcript's story only.
    assert not [e for e in client.events(sid) if e["type"] in DELTA_EVENTS]


def test_logs_follow_prints_the_pieces_as_they_come(
    client: Client, llm_server: LlmServer, write_agent: Any, module_settings: Settings
) -> None:
    scenario = llm_server.scenario([slow(ANSWER)])
    sid = client.start(write_agent(agent(scenario, llm_server.url)), "Weather?").session_id
    env = cli_env(module_settings.redis_url, module_settings.prefix)
    follower = subprocess.Popen(
        [*CLI, "session", "logs", sid, "--follow", "--json"], env=env, stdout=subprocess.PIPE, text=True
    )
    human = subprocess.Popen([*CLI, "session", "logs", sid, "--follow"], env=env, stdout=subprocess.PIPE, text=True)
    assert follower.stdout is not None and human.stdout is not None
    # Both follow the stream (they printed its first event) before the step starts.
    first, first_human = follower.stdout.readline(), human.stdout.readline()
    client.step(sid, timeout=60)
    out, _ = follower.communicate(timeout=60)
    lines, _ = human.communicate(timeout=60)
    out, lines = first + out, first_human + lines
    events = [json.loads(line) for line in out.splitlines()]
    pieces = [e for e in events if e["type"] == "text_delta"]
    assert len(pieces) >= 2 and "".join(e["text"] for e in pieces) == ANSWER
    assert [e["type"] for e in events][-2:] == ["completed", "step_committed"], "to the end's last event"
    assert "the model writes: " in lines
    assert (
        "".join(line.split("the model writes: ", 1)[1] for line in lines.splitlines() if "the model writes: " in line)
        == ANSWER
    )


def conversation() -> Any:
    """The same answers to the same conversation: a tool call, then text."""

    def reply(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["role"] == "tool":
            return slow("It is 21 degrees.", reasoning="The tool answered.", usage=(60, 7))
        r = calls(("lookup", {"city": "Paris", "days": [1, 2]}), reasoning="I look it up.", usage=(40, 11))
        r.content, r.chunk_chars, r.chunk_delay = "Let me look.", 4, 0.01
        return r

    return reply


def test_the_transcript_is_the_same_streamed_or_not(
    client: Client, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    scenario = llm_server.scenario([conversation()])
    tool = record_tool("lookup", tmp_path / "runs.jsonl")
    streamed = write_agent(agent(scenario, llm_server.url, tools=[tool]), "streamed.json")
    whole = write_agent(agent(scenario, llm_server.url, tools=[tool], stream=False), "whole.json")
    a = client.start(streamed, "Weather?", run=True, timeout=60, watch=True)
    b = client.start(whole, "Weather?", run=True, timeout=60)
    assert a.state == b.state == State.COMPLETED
    asked = llm_server.requests[scenario]
    assert [bool(r.get("stream")) for r in asked] == [True, True, False, False]

    def turns(sid: str) -> list[dict[str, Any]]:
        return [t.model_dump(exclude={"at", "duration_ms"}) for t in client.store.turns(sid)]

    assert turns(a.session_id) == turns(b.session_id)
    llm = [t for t in client.store.turns(a.session_id) if t.kind == "LlmTurn"]
    assert [t.text for t in llm] == ["Let me look.", "It is 21 degrees."]
    assert [t.usage.total_tokens for t in llm] == [51, 67]
    assert client.view(a.session_id).usage == client.view(b.session_id).usage


def test_an_interrupting_message_drops_the_answer_and_the_next_request_carries_it(
    client: Client, llm_server: LlmServer, write_agent: Any, module_settings: Settings
) -> None:
    long_answer = "word " * 400  # ~2.7 s at 3 characters per 20 ms
    scenario = llm_server.scenario([slow(long_answer, usage=(30, 400)), text("Berlin, then.", usage=(50, 4))])
    path = write_agent(agent(scenario, llm_server.url))
    sid = client.start(path, "Weather in Paris?", run=True, wait=False, watch=True).session_id
    wait_for(lambda: any(e["type"] == "text_delta" for e in client.events(sid)), what="the answer to stream")
    env = cli_env(module_settings.redis_url, module_settings.prefix)
    sent = agents("session", "send", sid, "-p", "No: Berlin.", "--interrupt", "--json", env=env)
    assert sent.returncode == 0, sent
    assert sent.doc["sent"] == "queued"
    wait_for(lambda: client.view(sid).state == State.COMPLETED, timeout=60, what="the session to complete")
    asked = llm_server.requests[scenario]
    assert len(asked) == 2
    assert [m["content"] for m in asked[1]["messages"] if m["role"] == "user"] == ["Weather in Paris?", "No: Berlin."]
    assert not [m for m in asked[1]["messages"] if m["role"] == "assistant"], "the dropped answer is not sent back"
    # (Whether the server saw the cut depends on its socket buffers: the interrupted event says it.)
    turns = client.store.turns(sid)
    assert [t.kind for t in turns] == ["UserTurn", "UserTurn", "LlmTurn"]
    assert turns[-1].text == "Berlin, then."
    view = client.view(sid)
    assert view.spent.model_calls == 2
    assert view.spent.tokens > 54, "the interrupted call's usage is counted"
    interrupted = [e for e in client.events(sid) if e["type"] == "model_interrupted"]
    assert len(interrupted) == 1 and 0 < interrupted[0]["dropped_chars"] < len(long_answer)


def test_send_says_whether_its_message_continued_or_was_queued(
    client: Client, llm_server: LlmServer, write_agent: Any, module_settings: Settings
) -> None:
    scenario = llm_server.scenario([text("Done.")])
    path = write_agent(agent(scenario, llm_server.url))
    sid = client.start(path, "Hello").session_id
    env = cli_env(module_settings.redis_url, module_settings.prefix)
    queued = agents("session", "send", sid, "-p", "and also this", "--json", env=env)
    assert queued.doc["sent"] == "queued"
    assert queued.doc["queued"] == [{"text": "and also this", "media": 0}]
    shown = agents("session", "show", sid, env=env)
    assert "and also this" in shown.stdout
    assert client.step(sid, timeout=60).state == State.COMPLETED
    assert client.view(sid).queued == []
    continued = agents("session", "send", sid, "-p", "thanks", env=env)
    assert continued.returncode == 0, continued
    assert "continued the conversation" in continued.stderr


def on_a_terminal(argv: list[str], env: dict[str, str], marker: str) -> tuple[str, float]:
    """Run the CLI with its stdout on a terminal (a pty); what it printed there, and how long
    before it exited `marker` had shown."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([*CLI, *argv], env=env, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(slave)
    out, first_piece_at = b"", None
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the process closed its end
            break
        if not chunk:
            break
        out += chunk
        if first_piece_at is None and marker.encode() in out:
            first_piece_at = time.monotonic()
    proc.wait(30)
    ended_at = time.monotonic()
    os.close(master)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert first_piece_at is not None, out
    return out.decode().replace("\r\n", "\n"), ended_at - first_piece_at


def test_run_on_a_terminal_prints_the_answer_as_it_streams_and_once(
    llm_server: LlmServer, write_agent: Any, module_settings: Settings, live_workers: Any
) -> None:
    scenario = llm_server.scenario([slow(ANSWER)])
    path = write_agent(agent(scenario, llm_server.url))
    env = cli_env(module_settings.redis_url, module_settings.prefix)
    printed, shown_for = on_a_terminal(["run", "--agent-file", str(path), "-p", "Weather?"], env, ANSWER[:10])
    assert printed.count(ANSWER[:30]) == 1, f"the answer once, not twice: {printed!r}"
    assert ANSWER in printed.replace("\n", "")
    assert shown_for > 0.5, "its start showed while it streamed"


@pytest.mark.parametrize("command", ["resume", "step"])
def test_resume_and_step_on_a_terminal_print_the_answer_as_it_streams_and_once(
    command: str, client: Client, llm_server: LlmServer, write_agent: Any, module_settings: Settings
) -> None:
    scenario = llm_server.scenario([slow(ANSWER)])
    sid = client.start(write_agent(agent(scenario, llm_server.url)), "Weather?").session_id  # paused: manual
    env = cli_env(module_settings.redis_url, module_settings.prefix)
    printed, shown_for = on_a_terminal(["session", command, sid], env, ANSWER[:10])
    assert printed.count(ANSWER[:30]) == 1, f"the answer once, not twice: {printed!r}"
    assert ANSWER in printed.replace("\n", "")
    assert shown_for > 0.5, "its start showed while it streamed"
    assert client.view(sid).response == ANSWER


def test_run_into_a_pipe_prints_the_answer_once_at_the_end(
    llm_server: LlmServer, write_agent: Any, module_settings: Settings, live_workers: Any
) -> None:
    scenario = llm_server.scenario([slow(ANSWER)])
    path = write_agent(agent(scenario, llm_server.url))
    done = agents(
        "run", "--agent-file", path, "-p", "Weather?", env=cli_env(module_settings.redis_url, module_settings.prefix)
    )
    assert done.returncode == 0, done
    assert done.stdout == ANSWER + "\n"


NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 3},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "when": {
            "type": "object",
            "properties": {
                "day": {"type": "string", "format": "date"},
                "hours": {"type": "array", "items": {"type": "integer", "minimum": 6, "maximum": 22}, "minItems": 2},
            },
            "required": ["day", "hours"],
        },
        "note": {"type": "string"},
    },
    "required": ["city", "unit", "when"],
    "additionalProperties": False,
}
FLAT = {
    "type": "object",
    "properties": {
        "seats": {"type": "integer", "minimum": 2, "maximum": 12},
        "terrace": {"type": "boolean"},
        "budget": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["quiet", "view"]}},
        "party": {"type": "string", "default": "family"},
    },
    "required": ["seats", "terrace", "budget"],
}


def test_the_test_tools_model_calls_each_tool_once_with_valid_arguments(
    client: Client, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    tools = [
        record_tool("forecast", log, parameters=NESTED),
        record_tool("book", log, parameters=FLAT),
    ]
    path = write_agent({"slug": "tools-test", "model": "test/tools", "tools": tools})
    view = client.start(path, "Try every tool.", run=True, timeout=60)
    assert view.state == State.COMPLETED
    ran = {r["tool"]: r["args"] for r in runs(log, phase="start")}
    assert sorted(ran) == ["book", "forecast"]
    jsonschema.validate(ran["forecast"], NESTED)
    jsonschema.validate(ran["book"], FLAT)
    assert ran["book"]["party"] == "family", "a default is used"
    assert ran["forecast"]["unit"] == "celsius", "the first of an enum"
    answer = view.response or ""
    assert answer.startswith("I called 2 tools.")
    for name, args in ran.items():
        assert json.dumps({"tool": name, "echo": args}) in answer, "each result is folded into the answer"


def test_a_session_nobody_follows_asks_its_model_for_whole_answers(
    client: Client, llm_server: LlmServer, write_agent: Any
) -> None:
    """Streaming costs litellm CPU for every chunk: a session run by a program that follows none of
    its events asks whole, and one followed (here `logs --follow`'s reader) streams."""
    scenario = llm_server.scenario([text("alone"), text("watched")])
    path = write_agent(agent(scenario, llm_server.url))
    alone = client.start(path, "Weather?", run=True, timeout=60)
    assert alone.response == "alone"
    assert not any(e["type"] == "text_delta" for e in client.events(alone.session_id))
    followed = client.start(path, "Weather?").session_id
    seen: list[dict[str, Any]] = []
    reader = follow(client, followed, seen)
    wait_for(lambda: bool(seen), what="the follower to read the stream")
    assert client.resume(followed, timeout=60).response == "watched"
    reader.join(timeout=30)
    assert [bool(r.get("stream")) for r in llm_server.requests[scenario]] == [False, True]
    assert "".join(e["text"] for e in seen if e["type"] == "text_delta") == "watched"
