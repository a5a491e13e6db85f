"""`agents doctor`: what an operator checks first."""

from __future__ import annotations

import re
from typing import Any

from celery_agents.store import COMPLETIONS_GROUP, CompletionStream
from celery_agents.store.keys import STORED_STATES
from celery_agents.tasks.config import QUEUES
from celery_agents.tasks.queues import QueueProbe

_SANDBOX_PARTS = (
    ("own_uid", "a uid per call"),
    ("run_cgroup", "a cgroup per call (memory and processes of the whole run)"),
    ("namespaces", "namespaces of their own (network, other runs and the worker's processes hidden)"),
    ("bubblewrap", "bubblewrap (filesystem and network hidden)"),
)


#: a completion waiting longer than this is stuck: a live consumer applies one within a second,
#: and takes over a dead consumer's within seconds
COMPLETIONS_STUCK_S = 30.0


def _completions_check(store: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The completions stream's consumer group: (check, figures)."""
    cs = CompletionStream(store.client, store.keys.completions, COMPLETIONS_GROUP).state()
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


def _lapsed_leases(store: Any, older_than: float, limit: int = 1000) -> int:
    """Steps and dispatched calls a worker picked up whose lease lapsed without an outcome."""
    r, k = store.client, store.keys
    cutoff = int(older_than * 1000)
    owed = r.zrangebyscore(k.owed, "-inf", cutoff, start=0, num=limit)
    calls = [m.split(" ", 1) for m in r.zrangebyscore(k.dispatched, "-inf", cutoff, start=0, num=limit)]
    pipe = r.pipeline(transaction=False)
    for sid in owed:
        pipe.hmget(k.meta(sid), ["version", "picked"])
        pipe.exists(k.lease(sid))
    for sid, field in calls:
        pipe.exists(k.call_started(sid, field))
        pipe.exists(k.call_lease(sid, field))
    rows = pipe.execute()
    n = 0
    for i in range(len(owed)):
        (version, picked), leased = rows[2 * i], rows[2 * i + 1]
        n += int(version is not None and picked == version and not leased)
    base = 2 * len(owed)
    for i in range(len(calls)):
        n += int(bool(rows[base + 2 * i]) and not rows[base + 2 * i + 1])
    return n


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


def diagnose(client: Any) -> dict[str, Any]:
    settings = client.settings
    store = client.store
    r = store.client
    k = store.keys
    checks: list[dict[str, Any]] = []
    info = r.info()
    checks.append(
        {
            "name": "redis",
            "ok": True,
            "detail": f"redis {info.get('redis_version')} at "
            + (_redact(settings.redis_url) if settings.redis_url else f"embedded ({settings.home})"),
        }
    )
    try:
        aof = r.config_get("appendonly").get("appendonly")
        fsync = r.config_get("appendfsync").get("appendfsync")
        policy = r.config_get("maxmemory-policy").get("maxmemory-policy")
    except Exception:  # managed Redis may forbid CONFIG
        aof = fsync = policy = None
    if aof is not None:
        checks.append(
            {
                "name": "persistence",
                "ok": aof == "yes",
                "detail": f"appendonly {aof}, appendfsync {fsync}"
                + ("" if aof == "yes" else " — turn AOF on or a restart loses sessions and completions")
                + (
                    " (a power cut loses up to ~1 s of acknowledged writes; `always` loses none)"
                    if aof == "yes" and fsync == "everysec"
                    else ""
                ),
            }
        )
    if policy is not None:
        checks.append(
            {
                "name": "eviction",
                "ok": policy == "noeviction",
                "detail": f"maxmemory-policy {policy}"
                + ("" if policy == "noeviction" else " — use noeviction or Redis may drop session state"),
            }
        )
    workers = store.live_workers()
    checks.append(
        {
            "name": "workers",
            "ok": bool(workers) or client.inline,
            "detail": f"{len(workers)} alive"
            + ("" if workers or client.inline else " — start one with `agents worker`"),
        }
    )
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
    probe = QueueProbe(settings, r)
    queues = {q: head.depth for q, head in probe.heads(QUEUES).items()}
    probe.close()
    if settings.broker_url:
        readable = None not in queues.values()
        checks.append(
            {
                "name": "broker",
                "ok": readable,
                "detail": _redact(settings.broker_url)
                + ("" if readable else " — cannot read its queues (is it up? are the credentials right?)"),
            }
        )
    now = store.server_time()  # owed and deadline scores are Redis times
    owed = int(r.zcount(k.owed, "-inf", "+inf"))
    stuck = int(r.zcount(k.owed, "-inf", int((now - settings.owed_grace) * 1000)))
    pending = int(r.zcard(k.pending_all))
    overdue = int(r.zcount(k.deadlines, "-inf", int(now * 1000)))
    rejected = int(r.xlen(k.rejected)) if r.exists(k.rejected) else 0
    states = {s: int(r.zcard(k.state_index(s))) for s in STORED_STATES}
    lapsed = _lapsed_leases(store, now - settings.owed_grace)
    served = {q for w in workers for q in w.get("queues", [])}
    unserved = {q: n for q, n in queues.items() if n and q not in served}
    if not client.inline or unserved:
        checks.append(
            {
                "name": "queues",
                "ok": not unserved,
                "detail": "every queue holding messages has a worker"
                if not unserved
                else "; ".join(
                    f"{n} message(s) wait on {q}, which no live worker consumes (agents worker --queues {q})"
                    for q, n in unserved.items()
                ),
            }
        )
    sampled, sampled_bytes = store.memory_per_session()
    checks.append(
        {
            "name": "leases",
            "ok": lapsed == 0 or bool(workers),
            "detail": f"{lapsed} step(s) or call(s) whose worker stopped renewing its lease"
            + ("" if not lapsed or workers else " — a worker takes them over once one runs"),
        }
    )
    checks.append(
        {
            "name": "owed steps",
            "ok": stuck == 0 or bool(workers),
            "detail": f"{owed} owed, {stuck} waiting longer than {settings.owed_grace:g} s",
        }
    )
    went_back, rewound = store.rewound()
    checks.append(
        {
            "name": "rewound sessions",
            # A warning: the writes are gone; workers re-read those sessions and go on from what is stored.
            "ok": went_back == 0,
            "detail": f"{went_back} session(s) found older than a worker had read them"
            + (
                ""
                if not went_back
                else " — Redis lost acknowledged writes (failover or power cut with appendfsync everysec): "
                + ", ".join(rewound)
            ),
        }
    )
    completions_check, completions = _completions_check(store)
    checks.append(completions_check)
    poison = int(r.llen(k.poison))
    checks.append(
        {
            "name": "poison messages",
            "ok": poison == 0,  # a warning: the workers set them aside and went on
            "detail": f"{poison} queue message(s) no worker could read, set aside in {k.poison}"
            + (" — see them with LRANGE, then DEL the list" if poison else ""),
        }
    )
    last_rejected = [{"id": eid, **fields} for eid, fields in (r.xrevrange(k.rejected, count=5) if rejected else [])]
    return {
        "ok": all(
            c["ok"]
            for c in checks
            if c["name"] in ("redis", "broker", "workers", "owed steps", "queues", "completions")
            or c.get("fails_doctor")
        ),
        "mode": "inline" if client.inline else "queue",
        "prefix": settings.prefix,
        "checks": checks,
        "workers": workers,
        "queues": queues,
        "owed_steps": owed,
        "lapsed_leases": lapsed,
        "pending_calls": pending,
        "overdue_deadlines": overdue,
        "rejected_completions": rejected,
        "rewound_sessions": rewound,
        "completions": completions,
        "poison_messages": poison,
        "recent_rejections": last_rejected,
        "sessions": states,
        # MEMORY USAGE of the most recent sessions' keys, averaged: what one more session costs.
        "memory_per_session_bytes": sampled_bytes // sampled if sampled else None,
        # The workers purge: their setting is the one that holds (the shortest, if they differ).
        "retention_days": min(
            (w["retention_days"] for w in workers if w.get("retention_days")), default=settings.retention_days
        ),
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
