"""History, fork and rerun through the Python API on real Redis, steps and tools run in this
process (the inline driver) with real command tools: every version is listed with what it did; a
fork has exactly its origin's turns up to the version, new tokens for the deferred calls it copies
unfinished, and leaves its origin as it was; a rerun reuses the origin's recorded results unless
fresh, and its dry run changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import InvalidInput, UnknownToken
from celery_agents.model import State
from tests.e2e.conftest import runs
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.test_approval_gates import agent, pay


def origin_state(rclient: redis.Redis, prefix: str, sid: str) -> dict[str, Any]:
    """Every key of the session, dumped: what "nothing of the origin changes" compares."""
    keys = sorted(rclient.scan_iter(f"{prefix}:s:{{{sid}}}:*"))
    return {k: rclient.dump(k) for k in keys}


def test_history_lists_every_version_with_what_it_did(settings: Settings, tmp_path: Path) -> None:
    llm = ScriptedLlm(llm_turn(pay("c1", 20)), llm_turn(text="paid twenty"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(tmp_path / "runs.log"), "pay bob 20", run=True).session_id
        history = client.history(sid)
        view = client.view(sid)
        other = client.start(agent(tmp_path / "runs.log"), "never mind").session_id
        client.cancel(other)
        cancelled = client.history(other)
    assert [v.version for v in history] == list(range(1, view.version + 1))
    assert [(v.kind, v.turns, v.head, v.state) for v in history] == [
        ("started", 1, "UserTurn", "ready"),
        ("llm", 2, "LlmTurn", "tools"),
        ("tools", 3, "UserTurn", "ready"),
        ("llm", 4, "LlmTurn", "completed"),
    ]
    assert history[0].summary == "started: pay bob 20"
    assert "pay(" in history[1].summary and "completed pay" in history[2].summary
    assert history[2].summary == "tools: completed pay, 1 tool result to the model"
    assert history[3].summary == "llm: model answered: paid twenty"
    assert all(v.at > 0 for v in history)
    assert [(v.version, v.kind, v.summary, v.turns) for v in cancelled] == [
        (1, "started", "started: never mind", 1),
        (2, "cancelled", "cancelled", 1),
    ]


def test_a_fork_has_the_origins_turns_up_to_the_version_and_the_origin_is_untouched(
    settings: Settings, tmp_path: Path, rclient: redis.Redis, prefix: str
) -> None:
    llm = ScriptedLlm(llm_turn(pay("c1", 20)), llm_turn(text="paid"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(tmp_path / "runs.log"), "pay", run=True).session_id
        before = origin_state(rclient, prefix, sid)
        origin = client.view(sid, detail=True)
        forks = {v: client.fork(sid, at=v) for v in (1, 2, 3, 4)}
        shown = {v: client.view(f.session_id, detail=True) for v, f in forks.items()}
        client_history = client.history(forks[3].session_id)
        other = client.fork(sid, at=2, agent=agent(tmp_path / "runs.log").model_copy(update={"slug": "other-payer"}))
        with pytest.raises(InvalidInput, match="no version 9"):
            client.fork(sid, at=9)
        assert origin_state(rclient, prefix, sid) == before, "nothing of the origin changed"
    for v, turns in {1: 1, 2: 2, 3: 3, 4: 4}.items():
        assert shown[v].turns == (origin.turns or [])[:turns]
        assert shown[v].forked_from is not None
        assert (shown[v].forked_from.session_id, shown[v].forked_from.version) == (sid, v)
        assert shown[v].session_id != sid
    assert [shown[v].state for v in (1, 2, 3, 4)] == [State.READY, State.TOOLS, State.READY, State.COMPLETED]
    assert shown[4].response == "paid"
    assert shown[2].agent == "payer" and other.agent == "other-payer" and other.state == State.TOOLS
    (forked,) = client_history
    assert (forked.version, forked.kind, forked.turns) == (1, "forked", 3)
    assert forked.summary == f"forked from {sid} at version 3"
    assert origin.to_json().get("forked_from") is None


def test_a_fork_of_a_waiting_session_gives_its_copied_deferred_calls_new_tokens(
    settings: Settings, tmp_path: Path, rclient: redis.Redis, prefix: str
) -> None:
    note = ("n1", "note", json.dumps({"x": 1}))
    llm = ScriptedLlm(llm_turn(note), llm_turn(text="noted in the fork"), llm_turn(text="noted"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(tmp_path / "runs.log"), "note it", run=True).session_id
        (waiting,) = client.view(sid).pending
        before = origin_state(rclient, prefix, sid)
        fork = client.fork(sid)
        assert origin_state(rclient, prefix, sid) == before, "nothing of the origin changed"
        (copied,) = fork.pending
        assert fork.state == State.WAITING and copied.session_id == fork.session_id
        assert copied.token and copied.token != waiting.token and copied.token.startswith(fork.session_id + ".")
        assert (copied.call_id, copied.tool, copied.digest) == (waiting.call_id, "note", waiting.digest)
        # The fork's token completes the fork's call only; the origin still waits on its own.
        client.complete(copied.token, {"written": "in the fork"})
        assert client.resume(fork.session_id).response == "noted in the fork"
        assert [p.token for p in client.view(sid).pending] == [waiting.token]
        with pytest.raises(UnknownToken):
            client.complete(f"{fork.session_id}.{(waiting.token or '').partition('.')[2]}", "x")
        client.complete(waiting.token or "", {"written": "in the origin"})
        assert client.resume(sid).response == "noted"


def test_rerun_reuses_recorded_results_and_fresh_runs_them_again(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    script = [llm_turn(pay("c1", 20), pay("c2", 30)), llm_turn(text="paid both")]
    llm = ScriptedLlm(*script, *script, *script)
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        assert len(runs(log, "pay", "start")) == 2
        rerun = client.rerun(sid, from_version=1)
        assert (rerun.state, rerun.response) == (State.COMPLETED, "paid both")
        assert len(runs(log, "pay", "start")) == 2, "recorded once across origin and rerun"
        calls = client.view(rerun.session_id, detail=True).calls or []
        assert all(c["meta"]["reused_from"].startswith(sid + ":") for c in calls) and len(calls) == 2
        assert json.loads(json.dumps(calls[0]["result"])) == client.view(sid, detail=True).calls[0]["result"]  # type: ignore[index]
        fresh = client.rerun(sid, from_version=1, fresh=True)
        assert fresh.state == State.COMPLETED
        assert len(runs(log, "pay", "start")) == 4, "fresh: both ran again"


def test_a_dry_run_lists_what_would_run_and_what_is_reused_and_changes_nothing(
    settings: Settings, tmp_path: Path, rclient: redis.Redis, prefix: str
) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 20), pay("c2", 500)), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id  # c2 waits at its gate
        everything = sorted(rclient.scan_iter(f"{prefix}:*"))
        before = {k: rclient.dump(k) for k in everything}
        plan = client.rerun_plan(sid, from_version=2)
        fresh = client.rerun_plan(sid, from_version=2, fresh=True)
        after = {k: rclient.dump(k) for k in sorted(rclient.scan_iter(f"{prefix}:*"))}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert after == before, f"a dry run changes nothing: {changed}"
    assert plan == {
        "would_run": [{"tool": "pay", "arguments": {"amount": 500, "to": "bob"}, "disposition": "defer"}],
        "reused": [{"tool": "pay", "arguments": {"amount": 20, "to": "bob"}, "disposition": "runSync"}],
    }
    assert [r["arguments"]["amount"] for r in fresh["would_run"]] == [20, 500] and fresh["reused"] == []


def test_bytes_per_fork_of_a_hundred_turn_session(
    settings: Settings, tmp_path: Path, rclient: redis.Redis, prefix: str, record_property: Any
) -> None:
    log = tmp_path / "runs.log"
    replies = [llm_turn(pay(f"c{i}", i)) for i in range(49)] + [llm_turn(text="all paid")]
    with Client(settings, inline=True, llm=ScriptedLlm(*replies)) as client:
        spec = agent(log).model_copy(update={"max_steps": 200})
        sid = client.start(spec, "pay everyone", run=True).session_id
        assert len(client.view(sid, detail=True).turns or []) == 100
        fork = client.fork(sid)

    def size(session: str) -> int:
        return sum(int(rclient.memory_usage(k) or 0) for k in rclient.scan_iter(f"{prefix}:s:{{{session}}}:*"))

    turns_bytes = int(rclient.memory_usage(f"{prefix}:s:{{{sid}}}:turns") or 0)
    forked = size(fork.session_id)
    record_property("fork_bytes", forked)
    print(f"100-turn session: origin {size(sid)} bytes (turns {turns_bytes}), fork {forked} bytes")
    assert forked < size(sid), "a fork copies the transcript, not the origin's calls or events"
    assert forked <= turns_bytes + 8_000, "the transcript and a few fixed-size keys"


def test_a_fork_before_a_child_finished_starts_a_fresh_child_and_after_reuses_its_answer(settings: Settings) -> None:
    from tests.test_client_tree import ByModel, boss, delegate

    approve = llm_turn(("a1", "approve", "{}"))
    llm = ByModel(
        boss=[delegate(), llm_turn(text="boss done"), llm_turn(text="fork done")],
        helper=[approve, approve.model_copy(), llm_turn(text="approved")],
    )
    with Client(settings, inline=True, llm=llm) as client:
        view = client.start(boss(), "go", run=True)
        (origin_child,) = view.children
        at = view.version  # the delegation is running: its child waits on a person
        # Before the child finished: the fork's delegation gets a child of its own, asked afresh.
        fork = client.fork(view.session_id, at=at)
        (copied,) = fork.pending
        assert (copied.tool, copied.state) == ("prompt_agent_helper", "queued"), "to run again, for the fork"
        waiting = client.resume(fork.session_id)
        (fresh_child,) = waiting.children
        assert fresh_child != origin_child and client.view(fresh_child).parent == fork.session_id
        assert client.view(origin_child).parent == view.session_id and client.view(view.session_id).children == [
            origin_child
        ]
        # The origin's child answers; a fork at the same version now reuses that recorded answer.
        (deferred,) = client.pending(origin_child)
        client.complete(deferred.token or "", "yes")
        assert client.resume(view.session_id).response == "boss done"
        asked = len(llm.asked)
        after = client.fork(view.session_id, at=at)
        assert after.state == State.READY and after.pending == [] and after.children == []
        assert client.resume(after.session_id).response == "fork done"
        assert [name for name, _ in llm.asked[asked:]] == ["boss"], "no child was asked again"


def test_a_fork_bound_to_another_agent_runs_copied_calls_as_that_agent_says(settings: Settings, tmp_path: Path) -> None:
    """`fork --agent-file`: an unfinished call copied into the fork takes the disposition the fork's
    agent gives it, never the origin's: a call a person had to supply is dispatched when the new
    agent runs it on its own, and one the new agent runs inline or does not have is not run."""
    log = tmp_path / "runs.log"
    note = ("n1", "note", json.dumps({"x": 1}))
    llm = ScriptedLlm(llm_turn(note), llm_turn(text="ran in the fork"))
    by_itself = agent(log, rules=[{"tool": "note", "disposition": "runAsync"}])
    inline = agent(log, rules=[{"tool": "note", "disposition": "runSync"}])
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "note it", run=True).session_id
        assert [p.tool for p in client.view(sid).pending] == ["note"]
        ran = client.fork(sid, agent=by_itself)
        (copied,) = ran.pending
        assert copied.token is None and copied.kind != "approval", "no person is asked: the fork's agent runs it"
        not_run = client.view(client.fork(sid, agent=inline).session_id, detail=True)
        no_tools = by_itself.model_copy(update={"tools": []})
        missing = client.view(client.fork(sid, agent=no_tools).session_id, detail=True)
        assert client.resume(ran.session_id).response == "ran in the fork"
        assert [r["args"] for r in runs(log, "note", "start")] == [{"x": 1}], "the fork's agent ran it by itself"
    for forked, why in ((not_run, "runs note in its step (runSync)"), (missing, "no tool")):
        (call,) = [c for c in forked.calls or [] if c["call_id"] == "n1"]
        assert call["state"] == "failed" and why in call["error"], call
        assert forked.pending == []
    assert len(runs(log, "note", "start")) == 1, "nothing else ran"
