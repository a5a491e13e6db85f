"""Printing the report of `agents doctor` (`Client.doctor` gives it; `celery_agents.diagnosis` says
what each check means)."""

from __future__ import annotations

from typing import Any


def render(report: dict[str, Any]) -> None:
    from celery_agents.cli.output import escape
    from celery_agents.cli.output import out as console  # the report is the command's output

    if "acknowledged_rewound" in report:
        console.print(f"acknowledged {len(report['acknowledged_rewound'])} rewound session(s)")
    for c in report["checks"]:
        mark = {"ok": "[green]ok[/]", "warning": "[yellow]!![/]", "error": "[red]fail[/]"}[c["severity"]]
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
    if report["deferred_calls"]["nearest"]:
        console.print("nearest deadlines of deferred calls:")
    for p in report["deferred_calls"]["nearest"]:
        then = f" then {p['then']}" if p["then"] else ""
        late = ", expiring" if p["expiring"] else ""
        console.print(
            f"  {escape(p['tool'])} of {p['session_id']}: {p['kind']}{then}, {p['seconds_left']:.0f} s left{late}, "
            f"digest {p['digest'][:16]}…"
        )
