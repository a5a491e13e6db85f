"""Completing deferred calls: from the CLI or the API, and from the `completions` stream that other
systems write to with nothing but a Redis client:

    XADD agents:completions * token <TOKEN> result <JSON-or-text> [error <message>] [by <name>]

Workers read that stream through a consumer group: an entry is applied with the same atomic script
as the CLI, then acknowledged and deleted, whatever its bytes; entries a dead worker had read are
taken over and applied first by the next consumer. Entries that change nothing are recorded in
`completions:rejected` with the reason. A worker's consumer applies and acknowledges an entry
through a Redis outage (up to AGENTS_REDIS_OUTAGE_SECONDS); its reads fail at once and its loop
reads again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from celery_agents import observe
from celery_agents.errors import (
    AgentsError,
    DigestMismatch,
    InvalidArguments,
    InvalidEntry,
    InvalidInput,
    InvalidResult,
    NotAnApproval,
    RedisRefused,
    RedisUnavailable,
    TokenAlreadyCompleted,
    TokenExpired,
    UntrustedSpec,
)
from celery_agents.model import AgentSpec, CompletionOutcome, TrackedCall
from celery_agents.model.limits import UnusableJson, check_depth, load_json
from celery_agents.runtime.faults import checkpoint
from celery_agents.scheduler.machine import schema_digest
from celery_agents.store import COMPLETIONS_GROUP, Decision, Store, completion_json
from celery_agents.store.codec import token_message
from celery_agents.store.stream import CompletionStream, GroupMissing

#: on several streams (a Cluster), the pause after a round that found nothing (s)
POLL_S = 0.05

log = logging.getLogger("celery_agents.completions")

GROUP = COMPLETIONS_GROUP
#: wake(session_id, version, priority): publish the step of a session that must go on
Wake = Callable[[str, int, int], None]
#: publishes a dispatched call (session id, call): an approved delegation starts its child so
Dispatch = Callable[[str, TrackedCall], None]


def parse_result_text(raw: str, max_bytes: int) -> Any:
    """JSON text is the result as that JSON value; any other text is the result as stripped text.
    Text over `max_bytes`, or JSON too deep or with too long a number, is refused (`InvalidResult`)."""
    check_result_bytes(len(raw.encode(errors="surrogatepass")), max_bytes)
    try:
        return load_json(raw)
    except json.JSONDecodeError:
        return raw.strip()
    except UnusableJson as exc:
        raise InvalidResult(f"the result is JSON celery-agents cannot use: {exc}") from None


def check_result_bytes(size: int, max_bytes: int) -> None:
    """The one rule on a result's size (CLI, API and the completions stream)."""
    if size > max_bytes:
        raise InvalidResult(
            f"the result is {size} bytes, more than the limit of {max_bytes} (AGENTS_MAX_RESULT_BYTES); "
            "store large results elsewhere and complete the call with a reference to them"
        )


def _json_kind(value: Any) -> str:
    """What a JSON value is, as JSON names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


def check_result(result: Any, max_bytes: int) -> None:
    """Refuse a result value that is empty, too deep or too big, before anything is recorded."""
    if result is None or (isinstance(result, str) and not result.strip()):
        raise InvalidResult("the result is empty: give the tool's result as JSON or text")
    try:
        check_depth(result)
    except UnusableJson as exc:
        raise InvalidResult(f"the result is JSON celery-agents cannot use: {exc}") from None
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    check_result_bytes(len(text.encode(errors="surrogatepass")), max_bytes)


#: the longest name of who decided (`by`), through every door (the HTTP API's bound)
MAX_BY_CHARS = 200


def check_by(by: str | None) -> None:
    """Refuse a `by` that is too long or not text, before anything is recorded (it is stored with
    the call's outcome and in the session's events)."""
    if by is None:
        return
    if len(by) > MAX_BY_CHARS:
        raise InvalidInput(f"by is at most {MAX_BY_CHARS} characters, not {len(by)}")
    try:
        check_depth(by)
    except UnusableJson as exc:
        raise InvalidInput(f"by is not text celery-agents can use: {exc}") from None


def complete(
    store: Store,
    token: str,
    result: Any,
    *,
    is_error: bool = False,
    by: str | None = None,
    wake: Wake | None = None,
    dispatch: Dispatch | None = None,
    now: float | None = None,
    entry: str = "",
    decision: Decision | None = None,
) -> CompletionOutcome:
    """Complete a deferred call; wakes the session through `wake(session_id, version, priority)` when its last
    unfinished call is done and it is auto-driven. Approving a deferred sub-agent call publishes it
    through `dispatch` instead (it starts the child session). Raises the token's conflict otherwise."""
    check_result(result, store.settings.max_result_bytes)
    check_by(by)
    # The deadline is checked against Redis's clock (unless a test gives `now`), not this host's.
    outcome = completion_json(result, is_error=is_error, by=by, now=time.time() if now is None else now)
    with observe.token_wait(store, token, by) as watch:
        try:
            done, version = store.complete_token(
                token,
                outcome,
                by=by or "",
                event={"by": by or "", "error": is_error, **({"decision": decision.outcome} if decision else {})},
                now=now,
                entry=entry,
                decision=decision,
            )
        except TokenExpired as exc:
            if wake is not None and "wake_version" in exc.details:
                wake(token.partition(".")[0], int(exc.details["wake_version"]), int(exc.details["wake_priority"]))
            raise
        watch.outcome = "failed" if is_error else "completed"
        if done.woken and wake is not None:
            wake(done.session_id, version, done.priority)
        if done.delegated is not None and dispatch is not None:
            dispatch(done.session_id, store.call(done.session_id, done.delegated))
    return done


def decide(
    store: Store,
    token: str,
    kind: Literal["approve", "reject"],
    *,
    arguments: Any = None,
    digest: str | None = None,
    for_session: bool = False,
    reason: str | None = None,
    by: str | None = None,
    wake: Wake | None = None,
    dispatch: Dispatch | None = None,
    entry: str = "",
) -> CompletionOutcome:
    """Approve (run under its `then`, with `arguments` when given: an edit) or reject (the model
    is told `rejected: <reason>`; the tool never runs) an approval gate. `digest`: refuse unless
    the pending call is the one decided on. `for_session`: later calls of the tool in the session
    run without asking. One decision per token; the token's conflict otherwise."""
    call, agent_hash = store.token_call(token, entry)
    if call.then is None:
        raise NotAnApproval(token_message("not_an_approval", token), token=token)
    if digest is not None and digest.strip().lower() != call.digest():
        raise DigestMismatch(token_message("digest_mismatch", token), token=token)
    by = by or None
    if kind == "reject":
        text = f"rejected: {reason.strip()}" if reason and reason.strip() else "rejected: a person declined the call"
        decision = Decision("reject", "rejected", digest=call.digest())
        return complete(store, token, text, is_error=True, by=by, wake=wake, entry=entry, decision=decision)
    sid = token.strip().partition(".")[0]
    if store.settings.spec_key is None and store.spec_signed(agent_hash, sid):
        # Recorded unsealed, the approval would be refused by every worker holding the key, and the
        # call would fail later; the person is told now and nothing is recorded.
        raise UntrustedSpec(
            "this session's agent spec is signed: approving one of its calls needs AGENTS_SPEC_KEY in this "
            "process's environment (without it no worker would run the approved call); nothing was recorded",
            agent_hash=agent_hash,
        )
    agent = store.agent(agent_hash, sid)
    approved = (
        call.arguments
        if arguments is None
        else _checked_arguments(agent, call, arguments, store.settings.max_result_bytes)
    )
    outcome: Literal["approved", "edited"] = "approved" if approved == call.arguments else "edited"
    tool = agent.tool(call.tool)
    grant = (call.tool, schema_digest(tool.parameters)) if for_session and tool is not None else None
    running = json.dumps(
        {"state": "running", "decision": outcome, "arguments": approved, "completed_by": by}, ensure_ascii=False
    )
    decision = Decision("approve", outcome, approved=running, digest=call.digest(), grant=grant)
    return complete(store, token, "approved", by=by, wake=wake, dispatch=dispatch, entry=entry, decision=decision)


def _checked_arguments(agent: AgentSpec, call: TrackedCall, arguments: Any, max_bytes: int) -> dict[str, Any]:
    """Edited arguments, refused (`invalid_arguments`) unless the tool's schema takes them and they
    are within `max_bytes` (AGENTS_MAX_RESULT_BYTES, as a result is)."""
    from celery_agents.tools.arguments import argument_problems

    if not isinstance(arguments, dict):
        raise InvalidArguments(f"the arguments of {call.tool} must be a JSON object, not {_json_kind(arguments)}")
    try:
        check_depth(arguments)
    except UnusableJson as exc:
        raise InvalidArguments(f"the arguments are JSON celery-agents cannot use: {exc}") from None
    size = len(json.dumps(arguments, ensure_ascii=False).encode())
    if size > max_bytes:
        raise InvalidArguments(
            f"the arguments are {size} bytes, more than the limit of {max_bytes} (AGENTS_MAX_RESULT_BYTES)"
        )
    tool = agent.tool(call.tool)
    if tool is not None:
        problems = argument_problems(tool.name, tool.parameters, arguments)
    else:  # a delegation: its child gets the prompt
        prompt = arguments.get("prompt")
        problems = None if isinstance(prompt, str) and prompt.strip() else 'give the task as {"prompt": "..."}'
    if problems:
        # Written for the model ("call it again..."): a person's edit is told only what is wrong.
        told = problems.rsplit(f" Call {call.tool} again", 1)[0]
        raise InvalidArguments(f"these arguments do not fit {call.tool}, nothing was run: {told}")
    return arguments


class CompletionConsumer:
    """Applies the entries of the `completions` stream, exactly once each in effect.

    Whatever an entry's bytes, it is applied or rejected (recorded in `completions:rejected` with a
    reason), then acknowledged and deleted; only a Redis failure leaves it pending. A new consumer
    first takes over and applies every entry other consumers read and did not acknowledge (a
    consumer that died), oldest first, and only then reads new ones: entries apply in stream order
    across a takeover, so of two completions of one token the first written wins."""

    def __init__(
        self, store: Store, name: str, wake: Wake | None = None, batch: int = 100, dispatch: Dispatch | None = None
    ) -> None:
        self.store, self.name, self.wake, self.dispatch = store, name, wake, dispatch
        self.batch = batch
        #: every index shard's stream (one on a single Redis)
        self.streams = store.completion_streams()
        self.stream = self.streams[0]
        self._taken_over = [False] * len(self.streams)

    def poll(self, block_ms: int | None = None) -> int:
        """Apply what waits; returns how many entries were handled. With one stream, waits up to
        `block_ms` for one (XREADGROUP BLOCK); with several (a Cluster's shards: one BLOCK cannot
        span slots), reads each in turn and, when none had any, pauses `POLL_S` (at most
        `block_ms`) before returning."""
        if len(self.streams) == 1:
            return self._poll_one(0, block_ms)
        handled = sum(self._poll_one(i, None) for i in range(len(self.streams)))
        if not handled and block_ms:
            time.sleep(min(POLL_S, block_ms / 1000))
        return handled

    def _poll_one(self, i: int, block_ms: int | None) -> int:
        stream = self.stream = self.streams[i]
        entries = []
        if not self._taken_over[i]:
            stream.ensure_group()
            entries = stream.claim_all(self.name, self.batch)
            self._taken_over[i] = True
        try:
            entries += stream.read_new(self.name, self.batch, None if entries else block_ms)
        except GroupMissing:
            self._taken_over[i] = False  # the stream was deleted meanwhile: make the group again
        if entries:
            checkpoint("completion_read", self.store, entries[0][0])
        for eid, fields in entries:
            self.apply(eid, fields, stream)
        return len(entries)

    def apply(
        self, entry_id: str, raw_fields: dict[bytes, bytes], stream: CompletionStream | None = None
    ) -> CompletionOutcome | None:
        """Apply one entry of `stream` (default: the one read last), or record why not; then
        acknowledge it. A Redis failure leaves it pending in the group, to be taken over."""
        store = self.store
        stream = stream or self.stream
        token, by = (_shown(raw_fields.get(name, b"")).strip() for name in (b"token", b"by"))
        done: CompletionOutcome | None = None
        try:
            fields = decode_entry(raw_fields)
            token, by = (fields.get("token") or "").strip(), fields.get("by") or ""
            if fields.get("decision") and fields.get("result") is None and not fields.get("error"):
                done = self._decide(token, fields, entry_id)
            else:
                result, is_error = _result(fields, store.settings.max_result_bytes), bool(fields.get("error"))
                done = complete(
                    store,
                    token,
                    result,
                    is_error=is_error,
                    by=by or None,
                    wake=self.wake,
                    dispatch=self.dispatch,
                    entry=entry_id,
                )
        except (RedisUnavailable, RedisRefused):
            raise  # pending in the group: applied again by whoever consumes next
        except TokenAlreadyCompleted as exc:
            if exc.details.get("same_entry"):
                # Applied already, by a consumer that stalled before acknowledging it: not a rejection.
                log.info("completion %s was applied before; acknowledged", entry_id)
            else:
                self._reject(entry_id, token, by, exc.code, exc.message)
        except AgentsError as exc:
            self._reject(entry_id, token, by, exc.code, exc.message)
        except Exception as exc:  # a bug or a script error on this entry: never block the stream on it
            log.exception("completion %s could not be applied", entry_id)
            self._reject(entry_id, token, by, "apply_failed", f"{type(exc).__name__}: {exc}")
        # Through an outage like the completion itself: unacknowledged, the next consumer takes it again.
        store.through_outage(lambda: stream.ack(entry_id))
        return done

    def _decide(self, token: str, fields: dict[str, str], entry_id: str) -> CompletionOutcome:
        """`decision approve|reject [arguments JSON] [digest HEX] [reason TEXT] [by NAME]`."""
        if not token:
            raise InvalidResult("the entry has no token field")
        kind = fields["decision"].strip().lower()
        if kind not in ("approve", "reject"):
            raise InvalidInput(f"decision is approve or reject, not {fields['decision'][:40]!r}")
        arguments = None
        if fields.get("arguments") is not None:
            try:
                arguments = load_json(fields["arguments"])
            except (json.JSONDecodeError, UnusableJson) as exc:
                raise InvalidArguments(f"the arguments are not JSON celery-agents can use: {exc}") from None
            if arguments is None:  # given, and null: an edit that is no object, not "as the model asked"
                raise InvalidArguments("the arguments must be a JSON object, not null")
        return decide(
            self.store,
            token,
            "approve" if kind == "approve" else "reject",
            arguments=arguments,
            digest=fields.get("digest") or None,
            reason=fields.get("reason"),
            by=fields.get("by") or None,
            wake=self.wake,
            dispatch=self.dispatch,
            entry=entry_id,
        )

    def _reject(self, entry_id: str, token: str, by: str, reason: str, message: str) -> None:
        self.store.through_outage(lambda: self.store.record_rejection(token, reason, message, by=by, entry=entry_id))
        log.info("completion %s rejected (%s): %s", entry_id, reason, message)


def decode_entry(raw_fields: dict[bytes, bytes]) -> dict[str, str]:
    """An entry's fields as text; an entry that is not UTF-8 is refused (`invalid_entry`)."""
    fields: dict[str, str] = {}
    for name, value in raw_fields.items():
        try:
            fields[name.decode("utf-8")] = value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidEntry(f"the field {_shown(name)!r} is not UTF-8 text") from None
    return fields


def _result(fields: dict[str, str], max_bytes: int) -> Any:
    if not fields.get("token", "").strip():
        raise InvalidResult("the entry has no token field")
    if fields.get("error"):
        return fields["error"]
    if fields.get("result") is None:
        raise InvalidResult("the entry has no result field")
    return parse_result_text(fields["result"], max_bytes)


def _shown(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")
