"""Completing deferred calls: from the CLI or the API, and from the `completions` stream that other
systems write to with nothing but a Redis client:

    XADD agents:completions * token <TOKEN> result <JSON-or-text> [error <message>] [by <name>]

Workers read that stream through a consumer group: an entry is applied with the same atomic script
as the CLI, then acknowledged and deleted; entries a dead worker had read are claimed by another
after `claim_idle` seconds. Entries that change nothing are recorded in `completions:rejected`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import redis

from celery_agents.errors import AgentsError, InvalidResult, TokenExpired
from celery_agents.model import CompletionOutcome
from celery_agents.model.limits import UnusableJson, check_depth, load_json
from celery_agents.store import Store, completion_json

log = logging.getLogger("celery_agents.completions")

GROUP = "celery-agents"
Wake = Callable[[str, int], None]


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
    now: float | None = None,
) -> CompletionOutcome:
    """Complete a deferred call; wakes the session through `wake(session_id, version)` when its last
    unfinished call is done and it is auto-driven. Raises the token's conflict otherwise."""
    check_result(result, store.settings.max_result_bytes)
    # The deadline is checked against Redis's clock (unless a test gives `now`), not this host's.
    outcome = completion_json(result, is_error=is_error, by=by, now=time.time() if now is None else now)
    try:
        done, version = store.complete_token(
            token, outcome, by=by or "", event={"by": by or "", "error": is_error}, now=now
        )
    except TokenExpired as exc:
        if wake is not None and "wake_version" in exc.details:
            wake(token.partition(".")[0], int(exc.details["wake_version"]))
        raise
    if done.woken and wake is not None:
        wake(done.session_id, version)
    return done


class CompletionConsumer:
    """Applies the entries of the `completions` stream, exactly once each in effect."""

    def __init__(
        self, store: Store, name: str, wake: Wake | None = None, claim_idle: float = 30.0, batch: int = 100
    ) -> None:
        self.store, self.name, self.wake = store, name, wake
        self.claim_idle_ms = int(claim_idle * 1000)
        self.batch = batch
        self._group_ready = False
        self._last_claim = 0.0

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.store.client.xgroup_create(self.store.keys.completions, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def poll(self, block_ms: int | None = None) -> int:
        """Apply what is waiting (claiming entries idle too long first); returns how many."""
        self._ensure_group()
        client, key = self.store.client, self.store.keys.completions
        entries: list[tuple[str, dict[str, str]]] = []
        now = time.monotonic()
        if now - self._last_claim >= self.claim_idle_ms / 3000:
            self._last_claim = now
            claimed = client.xautoclaim(key, GROUP, self.name, self.claim_idle_ms, "0-0", count=self.batch)
            entries.extend(e for e in claimed[1] if e and e[1])
        try:
            # Decoded RESP2 reply (redis-py types it as any protocol's): [[stream, [(id, fields), ...]]],
            # or nothing once the block ran out.
            res = cast(
                "list[tuple[str, list[tuple[str, dict[str, str]]]]] | None",
                client.xreadgroup(GROUP, self.name, {key: ">"}, count=self.batch, block=block_ms),
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False
            return 0
        for _stream, items in res or []:
            entries.extend(items)
        for eid, fields in entries:
            self.apply(eid, fields)
        return len(entries)

    def apply(self, entry_id: str, fields: dict[str, str]) -> CompletionOutcome | None:
        """Apply one entry; acknowledged once applied or rejected. A Redis failure leaves it pending
        in the group, to be claimed again."""
        store = self.store
        token = (fields.get("token") or "").strip()
        by = fields.get("by") or ""
        try:
            if not token:
                raise InvalidResult("the entry has no token field")
            error = fields.get("error")
            if error:
                result: Any = error
            elif fields.get("result") is None:
                raise InvalidResult("the entry has no result field")
            else:
                result = parse_result_text(fields["result"], store.settings.max_result_bytes)
            done: CompletionOutcome | None = complete(
                store, token, result, is_error=bool(error), by=by or None, wake=self.wake
            )
        except AgentsError as exc:
            store.record_rejection(token, exc.code, exc.message, by=by, entry=entry_id)
            log.info("completion %s rejected: %s", entry_id, exc.message)
            done = None
        pipe = store.client.pipeline(transaction=False)
        pipe.xack(store.keys.completions, GROUP, entry_id)
        pipe.xdel(store.keys.completions, entry_id)
        pipe.execute()
        return done
