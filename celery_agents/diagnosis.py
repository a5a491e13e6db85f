"""What `agents doctor` reports: what an operator checks first. Each check has a severity: `ok`,
`warning` (worth a look; doctor still passes) or `error` (doctor fails, exit 1). `Client.doctor`
gives the report; the CLI prints it."""

from __future__ import annotations

from typing import Any, Literal

from celery_agents.config import Settings
from celery_agents.model import PendingCall
from celery_agents.model.admission import limits_json
from celery_agents.model.recovery import worker_died
from celery_agents.redis_urls import redact_url
from celery_agents.store import Store
from celery_agents.store.durability import Persistence
from celery_agents.store.health import Backlog, Rewound, Waiting
from celery_agents.store.stream import GroupState
from celery_agents.tasks.config import QUEUES
from celery_agents.tasks.queues import QueueProbe

#: one line of the report: name, ok, severity, detail, and `fails_doctor` when a failure is an error
Check = dict[str, Any]
Severity = Literal["ok", "warning", "error"]


def check(name: str, ok: bool, detail: str, *, failure: Severity = "warning") -> Check:
    """A check whose failure is a `warning` or (`failure="error"`) fails doctor."""
    line: Check = {"name": name, "ok": ok, "severity": "ok" if ok else failure, "detail": detail}
    if failure == "error":
        line["fails_doctor"] = True  # as before `severity`: programs read it
    return line


_SANDBOX_PARTS = (
    ("own_uid", "a uid per call"),
    ("run_cgroup", "a cgroup per call (memory and processes of the whole run)"),
    ("namespaces", "namespaces of their own (network, other runs and the worker's processes hidden)"),
    ("bubblewrap", "bubblewrap (filesystem and network hidden)"),
)


#: a completion waiting longer than this is stuck: a live consumer applies one within a second,
#: and takes over a dead consumer's within seconds
COMPLETIONS_STUCK_S = 30.0


def _completions_check(store: Store) -> tuple[Check, dict[str, Any]]:
    """The completions stream's consumer group: (check, figures)."""
    states = [stream.state() for stream in store.completion_streams()]
    ages = [s.oldest_s for s in states if s.oldest_s is not None]
    lags = [s.lag for s in states]
    cs = GroupState(
        waiting=sum(s.waiting for s in states),
        pending=sum(s.pending for s in states),
        lag=None if None in lags else sum(int(n or 0) for n in lags),
        oldest_s=max(ages) if ages else None,
    )
    stuck = cs.oldest_s is not None and cs.oldest_s > COMPLETIONS_STUCK_S
    unread = "?" if cs.lag is None else cs.lag
    detail = f"{cs.waiting} waiting ({cs.pending} read but not acknowledged, {unread} unread)"
    if cs.oldest_s is not None:
        detail += f", oldest {cs.oldest_s:.0f} s"
    if stuck:
        detail += " — stuck: no worker applies them (is one running? see its log)"
    figures = {"waiting": cs.waiting, "pending": cs.pending, "lag": cs.lag, "oldest_s": cs.oldest_s}
    return check("completions", not stuck, detail, failure="error"), figures


def _lapsed_leases(store: Store, older_than: float) -> int:
    """Steps and dispatched calls a worker picked up whose lease lapsed without an outcome: those
    the sweeper publishes again because their worker died (`model.recovery`)."""
    return sum(worker_died(entry) for entry in store.due_entries(older_than))


def _sandbox_check(worker: dict[str, Any]) -> dict[str, Any]:
    """How an isolated worker confines calls. One that can contain nothing fails doctor (its
    isolated calls all fail); one without bubblewrap is a warning (the filesystem stays readable)."""
    box = worker["sandbox"]
    name = f"sandbox on {worker['name']}"
    contained = bool(box.get("contained"))
    if not contained:
        why = box.get("why") or "it can neither run bubblewrap nor create namespaces"
        return check(name, False, f"runs no isolated call: {why}", failure="error")
    strengths = [text for key, text in _SANDBOX_PARTS if box.get(key)]
    return check(
        name,
        bool(box.get("bubblewrap")),  # a warning only
        "runIsolated calls get rlimits"
        + "".join(f", {s}" for s in strengths)
        + ("" if box.get("bubblewrap") else " — no bubblewrap: files others may read stay readable"),
    )


def diagnose(settings: Settings, store: Store, *, inline: bool, ack_rewound: bool = False) -> dict[str, Any]:
    """The report; `ack_rewound` first acknowledges the rewound sessions recorded now."""
    acknowledged = store.acknowledge_rewound() if ack_rewound else None
    workers = store.live_workers()
    queues = _queue_depths(settings, store)
    now = store.server_time()  # owed and deadline scores are Redis times
    backlog = store.backlog(now, settings.owed_grace)
    lapsed = _lapsed_leases(store, now - settings.owed_grace)
    rewound = store.rewound_sessions()
    completions_check, completions = _completions_check(store)
    limits_check, limits = _limits_check(store)
    waiting = store.waiting(now)
    checks = [
        *_redis_checks(settings, store),
        *_worker_checks(settings, workers, inline),
        *_queue_checks(settings, queues, workers, inline),
        *_backlog_checks(settings, backlog, lapsed, bool(workers), _stuck_here(store, settings, now, inline, workers)),
        _rewound_check(rewound),
        completions_check,
        _poison_check(backlog.poison, store.keys.poison),
        limits_check,
        _waiting_check(waiting, now),
    ]
    sampled, sampled_bytes = store.memory_per_session()
    return {
        "ok": not any(c["severity"] == "error" for c in checks),
        "mode": "inline" if inline else "queue",
        "prefix": settings.prefix,
        "checks": checks,
        "workers": workers,
        "queues": queues,
        "owed_steps": backlog.owed,
        "lapsed_leases": lapsed,
        "pending_calls": backlog.pending,
        "overdue_deadlines": backlog.overdue,
        "rejected_completions": backlog.rejected,
        "rewound_sessions": rewound.sessions,
        "rewound_unacknowledged": rewound.unacknowledged,
        **({} if acknowledged is None else {"acknowledged_rewound": acknowledged}),
        "completions": completions,
        "limits": limits,
        "deferred_calls": _waiting_json(waiting, now),
        "poison_messages": backlog.poison,
        "recent_rejections": store.recent_rejections() if backlog.rejected else [],
        "sessions": backlog.sessions,
        # MEMORY USAGE of the most recent sessions' keys, averaged: what one more session costs.
        "memory_per_session_bytes": sampled_bytes // sampled if sampled else None,
        # The workers purge: their setting is the one that holds (the shortest, if they differ).
        "retention_days": min(
            (w["retention_days"] for w in workers if w.get("retention_days")), default=settings.retention_days
        ),
    }


def _queue_depths(settings: Settings, store: Store) -> dict[str, int | None]:
    probe = QueueProbe(settings, store.queue_lists())
    try:
        return {q: head.depth for q, head in probe.heads(QUEUES).items()}
    finally:
        probe.close()


def _redis_checks(settings: Settings, store: Store) -> list[Check]:
    """The server, its persistence and its eviction policy (where CONFIG may be read)."""
    where = redact_url(settings.redis_url) if settings.redis_url else f"embedded ({settings.home})"
    persistence = store.persistence()
    checks = [check("redis", True, f"redis {persistence.version} at {where}", failure="error")]
    if persistence.aof is not None:
        checks.append(_persistence_check(persistence, settings.ack_fsync))
    replicas = _replicas_check(settings, store)
    if replicas is not None:
        checks.append(replicas)
    policy = store.durability_config().get("maxmemory-policy")
    if policy is not None:
        warning = "" if policy == "noeviction" else " — use noeviction or Redis may drop session state"
        checks.append(check("eviction", policy == "noeviction", f"maxmemory-policy {policy}{warning}"))
    return checks


def _replicas_check(settings: Settings, store: Store) -> Check | None:
    """The replicas writes wait for (AGENTS_ACK_REPLICAS) are there; a warning when fewer are:
    writes then stand on the primary alone, and a failover may lose them."""
    online, need = store.replicas_online(), settings.replicas_to_ack
    if online is None or (need == 0 and online == 0):
        return None
    detail = f"{online} replica(s) online; writes wait for {need} (AGENTS_ACK_REPLICAS)"
    if need == 0:
        detail += " — a failover may lose the last writes (found as rewound sessions)"
    elif online < need:
        detail += " — fewer are online: writes stand on the primary alone and a failover may lose them"
    return check("replicas", online >= need, detail)


#: what each appendfsync loses of what Redis acknowledged (store/durability.py says why)
_FSYNC_LOSES = {
    "everysec": "a crash of Redis while a slow disk fsyncs loses up to ~2 s of the workers' acknowledged "
    "writes (those steps run again) and a power cut the last second or more; start, send and complete "
    "wait until Redis has written theirs",
    "no": "a power cut loses what the kernel had not written yet (up to ~30 s); a crash of Redis loses nothing",
}


def _persistence_check(p: Persistence, ack_fsync: bool) -> Check:
    """AOF off or not fsynced at every write: a warning saying what a crash or a power cut loses."""
    if not p.aof:
        return check("persistence", False, "appendonly no — a restart of Redis loses every session and completion")
    if p.fsync == "always":
        return check("persistence", True, "appendonly yes, appendfsync always: nothing acknowledged is lost")
    detail = f"appendonly yes, appendfsync {p.fsync or '?'} — " + _FSYNC_LOSES.get(
        p.fsync or "", "what a crash or a power cut loses is unknown (CONFIG may not be read)"
    )
    if p.fsync == "everysec" and ack_fsync:
        detail += (
            " and fsynced (AGENTS_ACK_FSYNC)"
            if p.waitaof
            else f" (AGENTS_ACK_FSYNC=1 needs WAITAOF, Redis ≥ 7.2; this is {p.version})"
        )
    return check("persistence", False, detail + "; `appendfsync always` loses nothing")


def _worker_checks(settings: Settings, workers: list[dict[str, Any]], inline: bool) -> list[Check]:
    """Live workers, how each isolated one confines calls, and whether specs are signed."""
    hint = "" if workers or inline else " — start one with `agents worker`"
    checks = [check("workers", bool(workers) or inline, f"{len(workers)} alive{hint}", failure="error")]
    checks += [_sandbox_check(w) for w in workers if w.get("sandbox") is not None]
    if not settings.embedded:
        signed = settings.spec_key is not None
        checks.append(
            check(
                "spec signing",
                signed,  # a warning only: doctor does not fail on it
                "agent specs are signed (AGENTS_SPEC_KEY)"
                if signed
                else "AGENTS_SPEC_KEY is unset — whoever can write to this Redis can make workers run their code",
            )
        )
    return checks


def _queue_checks(
    settings: Settings, queues: dict[str, int | None], workers: list[dict[str, Any]], inline: bool
) -> list[Check]:
    """The broker can be read, and every queue holding messages has a worker."""
    checks: list[Check] = []
    if settings.broker_url:
        readable = None not in queues.values()
        unreadable = "" if readable else " — cannot read its queues (is it up? are the credentials right?)"
        checks.append(check("broker", readable, redact_url(settings.broker_url) + unreadable, failure="error"))
    served = {q for w in workers for q in w.get("queues", [])}
    unserved = {q: n for q, n in queues.items() if n and q not in served}
    if not inline or unserved:
        detail = "; ".join(
            f"{n} message(s) wait on {q}, which no live worker consumes (agents worker --queues {q})"
            for q, n in unserved.items()
        )
        checks.append(
            check("queues", not unserved, detail or "every queue holding messages has a worker", failure="error")
        )
    return checks


def _stuck_here(
    store: Store, settings: Settings, now: float, inline: bool, workers: list[dict[str, Any]]
) -> list[str] | None:
    """Inline with no worker (the embedded default): the sessions whose owed steps wait, the
    oldest few (nothing runs them but a command here); else None."""
    if not inline or workers:
        return None
    return [sid for sid, _ in store.owed_due(now - settings.owed_grace, limit=3)]


def _backlog_checks(
    settings: Settings, backlog: Backlog, lapsed: int, workers: bool, here: list[str] | None = None
) -> list[Check]:
    """Work whose worker died, and owed steps waiting past the grace (fine while workers run).
    `here`: inline with no worker, the sessions whose steps wait for a command here to run them
    (a completion woke them): a warning that says how to go on, not a failure."""
    takeover = "" if not lapsed or workers else " — a worker takes them over once one runs"
    detail = f"{backlog.owed} owed, {backlog.stuck} waiting longer than {settings.owed_grace:g} s"
    if here is not None and backlog.stuck:
        more = ", …" if backlog.stuck > len(here) else ""
        detail += (
            " — no worker runs here: continue each with `agents session resume ID` (or start `agents worker`): "
            + ", ".join(here)
            + more
        )
    return [
        check(
            "leases",
            lapsed == 0 or workers,
            f"{lapsed} step(s) or call(s) whose worker stopped renewing its lease{takeover}",
        ),
        check(
            "owed steps",
            backlog.stuck == 0 or workers,
            detail,
            failure="warning" if here is not None else "error",
        ),
    ]


def _rewound_check(rewound: Rewound) -> Check:
    """An error until an operator acknowledges them: Redis lost writes it had acknowledged (an
    accepted completion may be gone, a step ran again) and only a person can tell what to redo."""
    detail = f"{rewound.count} session(s) found older than a worker had read them"
    if rewound.count:
        acknowledged = rewound.count - rewound.unacknowledged
        detail += (
            f" ({acknowledged} acknowledged) — Redis lost acknowledged writes (a failover, a crash or power cut "
            "with appendfsync everysec): completions given to them may be gone, see each with "
            "`agents session show`, then `agents doctor --ack-rewound`: "
            + ", ".join(rewound.sessions)
            + (", …" if rewound.count > len(rewound.sessions) else "")
        )
    return check("rewound sessions", rewound.unacknowledged == 0, detail, failure="error")


def _limits_check(store: Store) -> tuple[Check, dict[str, Any]]:
    """The fleet's limits on model calls, what they hold now, and the models paused (a provider's
    429): informational, a limit is a choice; `throttled` counts the calls each one made wait."""
    usages, pauses = store.limit_usages(), store.pauses()
    throttled = {key[1]: int(n) for key, n in store.counters().items() if key[0] == "model_calls_throttled"}
    parts = []
    for u in usages:
        held = f"{u.requests_this_minute} calls and {u.tokens_this_minute} tokens this minute"
        if u.limit.concurrency:
            held += f", {u.in_flight} in flight, {u.waiting} waiting"
        parts.append(f"{u.key} ({held}; {throttled.get(u.key, 0)} waits so far)")
    parts += [f"{p.model} paused for {max(0.0, p.until - store.server_time()):.0f} s more (429)" for p in pauses]
    detail = "; ".join(parts) if parts else "none set (agents limits set KEY --rpm N)"
    figures = {**limits_json(usages, pauses), "throttled": throttled}
    return check("limits", True, detail), figures


def _waiting_check(waiting: Waiting, now: float) -> Check:
    """Deferred calls waiting for a person: a warning while some are in their last tenth of the
    wait (their `call_expiring` is out), so that someone decides, or extends them, in time."""
    more = "+" if waiting.deferred > waiting.read else ""
    detail = (
        f"{waiting.deferred} waiting for a person ({waiting.gates}{more} approval gate(s)); "
        f"{waiting.expiring}{more} in the last tenth of their wait"
    )
    late = [p for p, expiring in waiting.nearest if expiring]
    if late:
        detail += " — nearest: " + ", ".join(f"{p.tool} of {p.session_id} in {_left(p, now):.0f} s" for p in late)
        detail += " (agents session pending; approve, reject, complete or extend them)"
    return check("deferred calls", waiting.expiring == 0, detail)


def _waiting_json(waiting: Waiting, now: float) -> dict[str, Any]:
    """The figures of the deferred calls waiting; the nearest without their token or arguments
    (a report may be shared: `pending` has those)."""
    nearest = [
        {
            **p.model_dump(mode="json", exclude={"token", "arguments"}),
            "seconds_left": round(_left(p, now), 1),
            "expiring": expiring,
        }
        for p, expiring in waiting.nearest
    ]
    return {
        "waiting": waiting.deferred,
        "read": waiting.read,
        "gates": waiting.gates,
        "expiring": waiting.expiring,
        "nearest": nearest,
    }


def _left(call: PendingCall, now: float) -> float:
    return max(0.0, (call.expires_at or now) - now)


def _poison_check(poison: int, key: str) -> Check:
    return check(
        "poison messages",
        poison == 0,  # a warning: the workers set them aside and went on
        f"{poison} queue message(s) no worker could read, set aside in {key}"
        + (" — see them with LRANGE, then DEL the list" if poison else ""),
    )
