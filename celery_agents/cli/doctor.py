"""`agents doctor`: what an operator checks first."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from celery_agents.config import Settings
from celery_agents.model.recovery import worker_died
from celery_agents.store import Store
from celery_agents.store.health import Backlog
from celery_agents.tasks.config import QUEUES
from celery_agents.tasks.queues import QueueProbe

if TYPE_CHECKING:
    from celery_agents.client import Client

#: one line of the report: name, ok, detail, and `fails_doctor` when a failure fails doctor
Check = dict[str, Any]

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
    cs = store.completion_stream().state()
    stuck = cs.oldest_s is not None and cs.oldest_s > COMPLETIONS_STUCK_S
    unread = "?" if cs.lag is None else cs.lag
    detail = f"{cs.waiting} waiting ({cs.pending} read but not acknowledged, {unread} unread)"
    if cs.oldest_s is not None:
        detail += f", oldest {cs.oldest_s:.0f} s"
    if stuck:
        detail += " — stuck: no worker applies them (is one running? see its log)"
    figures = {"waiting": cs.waiting, "pending": cs.pending, "lag": cs.lag, "oldest_s": cs.oldest_s}
    return {"name": "completions", "ok": not stuck, "detail": detail, "fails_doctor": True}, figures


def _redact(url: str) -> str:
    return re.sub(r"//([^@/]*)@", "//***@", url)


def _lapsed_leases(store: Store, older_than: float) -> int:
    """Steps and dispatched calls a worker picked up whose lease lapsed without an outcome: those
    the sweeper publishes again because their worker died (`model.recovery`)."""
    return sum(worker_died(entry) for entry in store.due_entries(older_than))


def _sandbox_check(worker: dict[str, Any]) -> dict[str, Any]:
    """How an isolated worker confines calls. One that can contain nothing fails doctor (its
    isolated calls all fail); one without bubblewrap is a warning (the filesystem stays readable)."""
    box = worker["sandbox"]
    name = f"sandbox on {worker['name']}"
    # Heartbeats of workers from before `contained` existed: bubblewrap was their only containment.
    contained = box.get("contained", bool(box.get("bubblewrap")))
    if not contained:
        why = box.get("why") or "it can neither run bubblewrap nor create namespaces"
        return {"name": name, "ok": False, "fails_doctor": True, "detail": f"runs no isolated call: {why}"}
    strengths = [text for key, text in _SANDBOX_PARTS if box.get(key)]
    return {
        "name": name,
        "ok": bool(box.get("bubblewrap")),  # a warning only
        "detail": "runIsolated calls get rlimits"
        + "".join(f", {s}" for s in strengths)
        + ("" if box.get("bubblewrap") else " — no bubblewrap: files others may read stay readable"),
    }


def diagnose(client: Client) -> dict[str, Any]:
    settings, store = client.settings, client.store
    workers = store.live_workers()
    queues = _queue_depths(settings, store)
    now = store.server_time()  # owed and deadline scores are Redis times
    backlog = store.backlog(now, settings.owed_grace)
    lapsed = _lapsed_leases(store, now - settings.owed_grace)
    went_back, rewound = store.rewound()
    completions_check, completions = _completions_check(store)
    checks = [
        *_redis_checks(settings, store),
        *_worker_checks(settings, workers, client.inline),
        *_queue_checks(settings, queues, workers, client.inline),
        *_backlog_checks(settings, backlog, lapsed, bool(workers)),
        _rewound_check(went_back, rewound),
        completions_check,
        _poison_check(backlog.poison, store.keys.poison),
    ]
    sampled, sampled_bytes = store.memory_per_session()
    return {
        "ok": all(c["ok"] for c in checks if c["name"] in _FAILING or c.get("fails_doctor")),
        "mode": "inline" if client.inline else "queue",
        "prefix": settings.prefix,
        "checks": checks,
        "workers": workers,
        "queues": queues,
        "owed_steps": backlog.owed,
        "lapsed_leases": lapsed,
        "pending_calls": backlog.pending,
        "overdue_deadlines": backlog.overdue,
        "rejected_completions": backlog.rejected,
        "rewound_sessions": rewound,
        "completions": completions,
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


#: checks that fail doctor (the others warn), besides those marked `fails_doctor`
_FAILING = ("redis", "broker", "workers", "owed steps", "queues", "completions")


def _queue_depths(settings: Settings, store: Store) -> dict[str, int | None]:
    probe = QueueProbe(settings, store.client)
    try:
        return {q: head.depth for q, head in probe.heads(QUEUES).items()}
    finally:
        probe.close()


def _redis_checks(settings: Settings, store: Store) -> list[Check]:
    """The server, its persistence and its eviction policy (where CONFIG may be read)."""
    where = _redact(settings.redis_url) if settings.redis_url else f"embedded ({settings.home})"
    checks: list[Check] = [
        {"name": "redis", "ok": True, "detail": f"redis {store.server_info().get('redis_version')} at {where}"}
    ]
    config = store.durability_config()
    aof, fsync, policy = (config.get(n) for n in ("appendonly", "appendfsync", "maxmemory-policy"))
    if aof is not None:
        detail = f"appendonly {aof}, appendfsync {fsync}"
        if aof != "yes":
            detail += " — turn AOF on or a restart loses sessions and completions"
        elif fsync == "everysec":
            detail += " (a power cut loses up to ~1 s of acknowledged writes; `always` loses none)"
        checks.append({"name": "persistence", "ok": aof == "yes", "detail": detail})
    if policy is not None:
        warning = "" if policy == "noeviction" else " — use noeviction or Redis may drop session state"
        checks.append(
            {"name": "eviction", "ok": policy == "noeviction", "detail": f"maxmemory-policy {policy}{warning}"}
        )
    return checks


def _worker_checks(settings: Settings, workers: list[dict[str, Any]], inline: bool) -> list[Check]:
    """Live workers, how each isolated one confines calls, and whether specs are signed."""
    hint = "" if workers or inline else " — start one with `agents worker`"
    checks: list[Check] = [{"name": "workers", "ok": bool(workers) or inline, "detail": f"{len(workers)} alive{hint}"}]
    checks += [_sandbox_check(w) for w in workers if w.get("sandbox") is not None]
    if not settings.embedded:
        checks.append(
            {
                "name": "spec signing",
                "ok": settings.spec_key is not None,  # a warning only: doctor does not fail on it
                "detail": "agent specs are signed (AGENTS_SPEC_KEY)"
                if settings.spec_key
                else "AGENTS_SPEC_KEY is unset — whoever can write to this Redis can make workers run their code",
            }
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
        checks.append({"name": "broker", "ok": readable, "detail": _redact(settings.broker_url) + unreadable})
    served = {q for w in workers for q in w.get("queues", [])}
    unserved = {q: n for q, n in queues.items() if n and q not in served}
    if not inline or unserved:
        detail = "; ".join(
            f"{n} message(s) wait on {q}, which no live worker consumes (agents worker --queues {q})"
            for q, n in unserved.items()
        )
        checks.append(
            {"name": "queues", "ok": not unserved, "detail": detail or "every queue holding messages has a worker"}
        )
    return checks


def _backlog_checks(settings: Settings, backlog: Backlog, lapsed: int, workers: bool) -> list[Check]:
    """Work whose worker died, and owed steps waiting past the grace (fine while workers run)."""
    takeover = "" if not lapsed or workers else " — a worker takes them over once one runs"
    return [
        {
            "name": "leases",
            "ok": lapsed == 0 or workers,
            "detail": f"{lapsed} step(s) or call(s) whose worker stopped renewing its lease{takeover}",
        },
        {
            "name": "owed steps",
            "ok": backlog.stuck == 0 or workers,
            "detail": f"{backlog.owed} owed, {backlog.stuck} waiting longer than {settings.owed_grace:g} s",
        },
    ]


def _rewound_check(went_back: int, rewound: dict[str, dict[str, Any]]) -> Check:
    detail = f"{went_back} session(s) found older than a worker had read them"
    if went_back:
        detail += " — Redis lost acknowledged writes (failover or power cut with appendfsync everysec): " + ", ".join(
            rewound
        )
    # A warning: the writes are gone; workers re-read those sessions and go on from what is stored.
    return {"name": "rewound sessions", "ok": went_back == 0, "detail": detail}


def _poison_check(poison: int, key: str) -> Check:
    return {
        "name": "poison messages",
        "ok": poison == 0,  # a warning: the workers set them aside and went on
        "detail": f"{poison} queue message(s) no worker could read, set aside in {key}"
        + (" — see them with LRANGE, then DEL the list" if poison else ""),
    }


def render(report: dict[str, Any]) -> None:
    from celery_agents.cli.output import escape
    from celery_agents.cli.output import out as console  # the report is the command's output

    for c in report["checks"]:
        mark = "[green]ok[/]" if c["ok"] else "[red]fail[/]" if c.get("fails_doctor") else "[yellow]!![/]"
        console.print(f"{mark} {c['name']}: {c['detail']}")
    console.print(
        "queues: "
        + ", ".join(f"{q} {'?' if n is None else n}" for q, n in report["queues"].items())
        + (" (the broker could not be read)" if None in report["queues"].values() else "")
    )
    console.print("sessions: " + ", ".join(f"{s} {n}" for s, n in report["sessions"].items()))
    per = report.get("memory_per_session_bytes")
    retention = report.get("retention_days")
    console.print(
        f"memory per session: {'-' if per is None else f'{per / 1024:.1f} KiB'} (recent sessions); retention: "
        + (f"finished sessions deleted after {retention:g} days" if retention else "off (AGENTS_RETENTION_DAYS)")
    )
    console.print(
        f"pending calls {report['pending_calls']}, overdue deadlines {report['overdue_deadlines']}, "
        f"rejected completions {report['rejected_completions']}"
    )
    for rej in report["recent_rejections"]:
        # What a completer wrote: shown, never obeyed by the terminal.
        console.print(f"  rejected {escape(rej.get('token', '')[:40])}: {escape(rej.get('reason', ''))}")
