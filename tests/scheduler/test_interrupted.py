"""A model call cancelled by an interrupting message (`send --interrupt`): the step keeps the turns
the call was given, counts what it spent and leaves the session ready for the next model call."""

from __future__ import annotations

from celery_agents.model import LlmTurn, State, Status, Usage, UserQuery
from celery_agents.scheduler import LlmRequest, advance
from celery_agents.scheduler.ports import LlmInterrupted
from tests.scheduler.fakes import ask, make_agent, ports, snapshot

AGENT = make_agent()


class InterruptedLlm:
    def __init__(self, exc: LlmInterrupted) -> None:
        self.exc = exc
        self.requests: list[LlmRequest] = []

    def complete(self, request: LlmRequest) -> LlmTurn:
        self.requests.append(request)
        raise self.exc


def test_an_interrupted_call_commits_what_it_was_given_and_its_spend_and_is_ready_again() -> None:
    usage = Usage(prompt_tokens=30, completion_tokens=12, total_tokens=42, cost=0.001)
    llm = InterruptedLlm(LlmInterrupted(usage, model="fake/model", chars=57))
    snap = snapshot(AGENT, [ask()])
    snap.inbox = [UserQuery(text="and Lyon?")]
    t = advance(snap, ports(llm=llm))  # type: ignore[arg-type]
    assert t.commit and t.kind == "interrupted"
    assert [(turn.kind, turn.query.text if turn.query else None) for turn in t.new_turns] == [  # type: ignore[union-attr]
        ("UserTurn", "and Lyon?")
    ], "the message the call was given is kept; nothing of its answer"
    assert (t.head, t.state, t.status, t.response) == ("UserTurn", State.READY, Status.ACTIVE, None)
    assert t.inbox_taken == 1
    assert (t.spend.tokens, t.spend.cost_usd, t.spend.model_calls) == (42, 0.001, 1)
    assert t.usage == usage and t.counts_as_step
    assert [(e.type, e.data["dropped_chars"]) for e in t.events] == [("model_interrupted", 57)]


def test_a_call_interrupted_before_it_started_spends_nothing() -> None:
    llm = InterruptedLlm(LlmInterrupted(Usage(), called=False))
    t = advance(snapshot(AGENT, [ask()]), ports(llm=llm))  # type: ignore[arg-type]
    assert t.kind == "interrupted" and t.new_turns == [] and t.head == "UserTurn"
    assert t.spend.nothing and not t.counts_as_step
