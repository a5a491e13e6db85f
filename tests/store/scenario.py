"""Bringing a stored session into a given state through the real scripts: start it, run steps with
the pure scheduler and scripted ports, commit them with `Store.commit`."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import cast

from celery_agents.model import AgentSpec, TrackedCall, UserQuery
from celery_agents.runtime import commit_transition
from celery_agents.scheduler import Ports, Snapshot, Transition, advance
from celery_agents.store import Committed, Loaded, Store, new_token, parse_token
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn, make_agent

AGENT = make_agent(executionMode="asynchronous", maxSteps=1000)


class WallClock:
    def now(self) -> float:
        return time.time()


class RealIds:
    def token(self, session_id: str) -> str:
        return new_token(session_id)

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(6)}"


def start(
    store: Store,
    *,
    drive: str = "manual",
    owe: bool = False,
    agent: AgentSpec = AGENT,
    text: str = "What is the weather in Paris?",
    now: float | None = None,
) -> str:
    return store.create_session(agent, UserQuery(text=text), drive=drive, owe=owe, now=now).session_id


def begin(store: Store, sid: str, owner: str = "w1", version: int | None = None) -> Loaded:
    v = store.header(sid).version if version is None else version
    begun = store.begin_step(sid, v, owner, request="test")
    assert begun.loaded is not None, begun
    return begun.loaded


def decide(
    store: Store, loaded: Loaded, llm: ScriptedLlm | None = None, tools: RecordingTools | None = None
) -> Transition:
    snap = Snapshot(
        header=loaded.header,
        agent=store.agent(loaded.header.agent_hash, loaded.header.session_id),
        turns=loaded.turns,
        calls=loaded.calls,
        inbox=loaded.inbox,
    )
    return advance(
        snap,
        Ports(llm=llm or ScriptedLlm(), tools=tools or RecordingTools(), clock=WallClock(), ids=RealIds()),
    )


def commit(
    store: Store, sid: str, loaded: Loaded, t: Transition, owner: str = "w1", now: float | None = None
) -> Committed:
    return commit_transition(store, loaded.header, owner, t, request="test", now=now)


@dataclass
class Stepped:
    transition: Transition
    result: Committed | None


def step(
    store: Store,
    sid: str,
    llm: ScriptedLlm | None = None,
    tools: RecordingTools | None = None,
    owner: str = "w1",
    now: float | None = None,
) -> Stepped:
    """One whole step: begin, decide, then commit (or end the step when there is nothing to write)."""
    loaded = begin(store, sid, owner)
    t = decide(store, loaded, llm, tools)
    if not t.commit:
        store.end_step(sid, owner, "test", t.kind)
        return Stepped(t, None)
    res = commit(store, sid, loaded, t, owner, now=now)
    assert res.outcome == "ok", res
    return Stepped(t, res)


def waiting_on(store: Store, *calls: tuple[str, str], drive: str = "manual") -> tuple[str, list[TrackedCall]]:
    """A session whose model asked for `(call_id, tool)` calls and whose tools step has run:
    returns the session id and the calls as committed (in call order)."""
    sid = start(store, drive=drive)
    step(store, sid, llm=ScriptedLlm(llm_turn(*[(cid, tool, '{"n": 1}') for cid, tool in calls])))
    done = step(store, sid)
    return sid, done.transition.calls


def token_hash(store: Store, token: str) -> dict[str, str]:
    """What Redis holds for a token (its hash; empty when there is none)."""
    sid, secret = parse_token(token)
    return cast("dict[str, str]", store.client.hgetall(store.keys.token(sid, secret)))


def token_of(calls: list[TrackedCall], call_id: str) -> str:
    for c in calls:
        if c.call_id == call_id:
            assert c.token
            return c.token
    raise AssertionError(f"no call {call_id}")
