"""Completing deferred calls: from the CLI or the API, and from the `completions` stream that other
systems write to with nothing but a Redis client:

    XADD agents:completions * token <TOKEN> result <JSON-or-text> [error <message>] [by <name>]

Workers read that stream through a consumer group: an entry is applied with the same atomic script
as the CLI, then acknowledged and deleted, whatever its bytes; entries a dead worker had read are
taken over and applied first by the next consumer. Entries that change nothing are recorded in
`completions:rejected` with the reason.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from celery_agents import observe
from celery_agents.errors import AgentsError, InvalidEntry, InvalidResult, TokenExpired
from celery_agents.model import CompletionOutcome, TrackedCall
from celery_agents.model.limits import UnusableJson, check_depth, load_json
from celery_agents.runtime.faults import checkpoint
from celery_agents.store import COMPLETIONS_GROUP, Store, completion_json

log = logging.getLogger("celery_agents.completions")

GROUP = COMPLETIONS_GROUP
Wake = Callable[[str, int], None]
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
) -> CompletionOutcome:
    """Complete a deferred call; wakes the session through `wake(session_id, version)` when its last
    unfinished call is done and it is auto-driven. Approving a deferred sub-agent call publishes it
    through `dispatch` instead (it starts the child session). Raises the token's conflict otherwise."""
    check_result(result, store.settings.max_result_bytes)
    # The deadline is checked against Redis's clock (unless a test gives `now`), not this host's.
    outcome = completion_json(result, is_error=is_error, by=by, now=time.time() if now is None else now)
    with observe.token_wait(store, token, by) as watch:
        try:
            done, version = store.complete_token(
                token, outcome, by=by or "", event={"by": by or "", "error": is_error}, now=now
            )
        except TokenExpired as exc:
            if wake is not None and "wake_version" in exc.details:
                wake(token.partition(".")[0], int(exc.details["wake_version"]))
            raise
        watch.outcome = "failed" if is_error else "completed"
        if done.woken and wake is not None:
            wake(done.session_id, version)
        if done.delegated is not None and dispatch is not None:
            dispatch(done.session_id, store.call(done.session_id, done.delegated))
    return done


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
        self.stream = store.completion_stream()
        self._taken_over = False

    def poll(self, block_ms: int | None = None) -> int:
        """Apply what waits; returns how many entries were handled."""
        entries = []
        if not self._taken_over:
            self.stream.ensure_group()
            entries = self.stream.claim_all(self.name, self.batch)
            self._taken_over = True
        try:
            entries += self.stream.read_new(self.name, self.batch, None if entries else block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._taken_over = False  # the stream was deleted meanwhile: make the group again
        if entries:
            checkpoint("completion_read", self.store, entries[0][0])
        for eid, fields in entries:
            self.apply(eid, fields)
        return len(entries)

    def apply(self, entry_id: str, raw_fields: dict[bytes, bytes]) -> CompletionOutcome | None:
        """Apply one entry, or record why not; then acknowledge it. A Redis failure leaves it
        pending in the group, to be taken over."""
        store = self.store
        token, by = (_shown(raw_fields.get(name, b"")).strip() for name in (b"token", b"by"))
        done: CompletionOutcome | None = None
        try:
            fields = decode_entry(raw_fields)
            token, by = (fields.get("token") or "").strip(), fields.get("by") or ""
            result, is_error = _result(fields, store.settings.max_result_bytes), bool(fields.get("error"))
            done = complete(
                store, token, result, is_error=is_error, by=by or None, wake=self.wake, dispatch=self.dispatch
            )
            observe.completion("applied")
        except AgentsError as exc:
            self._reject(entry_id, token, by, exc.code, exc.message)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as exc:  # a bug or a script error on this entry: never block the stream on it
            log.exception("completion %s could not be applied", entry_id)
            self._reject(entry_id, token, by, "apply_failed", f"{type(exc).__name__}: {exc}")
        self.stream.ack(entry_id)
        return done

    def _reject(self, entry_id: str, token: str, by: str, reason: str, message: str) -> None:
        observe.completion(reason)
        self.store.record_rejection(token, reason, message, by=by, entry=entry_id)
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
