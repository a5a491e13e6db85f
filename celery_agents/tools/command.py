"""Command tools (and agents-exe `script` tools): argv, arguments on stdin, the answer on stdout.

Relative paths in argv resolve against the agent file's folder. The environment carries the
call's `AGENTS_SESSION_ID`, `AGENTS_CALL_ID` and `AGENTS_IDEMPOTENCY_KEY`. Exit 0: stdout is the
result (JSON when it parses, else text); non-zero: a failed call with stderr as its error, which
the tool marks retryable with exit status 75 (EX_TEMPFAIL); killed by a signal or at its timeout:
a failed call saying so.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from celery_agents.model import CallMeta, CallOutcome
from celery_agents.model.agent import Limits
from celery_agents.tools.output import capped_note, media_from_bytes, parse_output, split_media
from celery_agents.tools.process import ProcessResult

#: the exit status a tool uses to say "try me again" (sysexits' EX_TEMPFAIL)
EX_TEMPFAIL = 75
#: how much of stderr the model gets as the error of a failed call
ERROR_CHARS = 4000


#: in a command, the Python interpreter celery-agents runs on (not `python3` from PATH)
PYTHON_PLACEHOLDER = "{python}"


def resolve_argv(argv: list[str], base_dir: str | None) -> list[str]:
    """`{python}` becomes this interpreter; relative paths that exist under the agent file's
    folder become absolute (a sandboxed run works in a directory of its own, so `tools/x.py`
    must not depend on the working directory)."""
    argv = [sys.executable if a == PYTHON_PLACEHOLDER else a for a in argv]
    if not base_dir:
        return list(argv)
    out = []
    for arg in argv:
        if arg and not os.path.isabs(arg) and not arg.startswith("-"):
            candidate = Path(base_dir) / arg
            if candidate.exists():
                out.append(str(candidate))
                continue
        out.append(arg)
    return out


#: what a command or python tool (runSync, runAsync) gets of the worker's own environment, besides
#: the call's variables, the names its `env` lists and those of AGENTS_TOOL_ENV
TOOL_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")


def tool_environment(call_vars: dict[str, str], names: Iterable[str], shared: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a tool's process: an allow-list of the worker's environment (never its
    own `AGENTS_*` settings, its Redis URL, its keys), then the call's variables."""
    env = {k: os.environ[k] for k in TOOL_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    for name in (*shared, *names):
        if name in os.environ and not name.upper().startswith("AGENTS_"):
            env[name] = os.environ[name]
    env.update(call_vars)
    return env


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= ERROR_CHARS else "…" + text[-ERROR_CHARS:]


def _killed_by(sig: int, limits: Limits | None) -> str:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    why = ""
    if sig == signal.SIGXCPU:
        why = (
            f": it used up its CPU time limit ({limits.cpu_seconds} s)"
            if limits and limits.cpu_seconds
            else ": it used up its CPU time limit"
        )
    elif sig == signal.SIGXFSZ:
        why = ": it wrote a file past its file size limit"
    elif sig == signal.SIGKILL and limits is not None:
        why = " (a resource limit, or the system, killed it)"
    elif sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) and limits and limits.memory_mb:
        why = f" (it may have run out of memory: the limit is {limits.memory_mb} MB)"
    return f"the tool was killed by {name}{why}"


def outcome_of(
    res: ProcessResult,
    *,
    timeout: float,
    empty_result: str | None = None,
    media_type: str | None = None,
    limits: Limits | None = None,
) -> CallOutcome:
    """The call's outcome from how its process ended."""
    stderr = res.stderr.decode(errors="replace")
    base: dict[str, Any] = {"duration_ms": res.duration_ms, "exit_status": res.exit_status}
    if res.timed_out:
        return CallOutcome(
            state="failed",
            **base,
            meta=CallMeta(timed_out=True, retryable=True),
            error=(
                f"the tool did not finish within {timeout:g} s and was killed (its whole process group: "
                "SIGTERM, then SIGKILL)" + (f"; its last error output: {_tail(stderr)}" if stderr.strip() else "")
            ),
        )
    if res.exit_status is None:
        return CallOutcome(state="failed", **base, error=_tail(stderr) or "the tool could not be started")
    if res.exit_status < 0:
        text = _killed_by(-res.exit_status, limits)
        return CallOutcome(
            state="failed",
            **base,
            meta=CallMeta(signal=-res.exit_status),
            error=text + (f"; its error output: {_tail(stderr)}" if stderr.strip() else ""),
        )
    if res.exit_status != 0:
        return CallOutcome(
            state="failed",
            **base,
            meta=CallMeta(retryable=res.exit_status == EX_TEMPFAIL),
            error=_tail(stderr) or f"the tool exited with status {res.exit_status}",
        )
    meta = CallMeta()
    if res.stdout_truncated:
        meta = CallMeta(output_capped={"written": res.stdout_bytes, "cap": len(res.stdout)})
    if media_type and res.stdout and not res.stdout_truncated:
        media = media_from_bytes(res.stdout, media_type)
        return CallOutcome(
            state="completed",
            **base,
            media=[media],
            meta=meta,
            result=f"attached: {media_type} ({len(res.stdout)} bytes)",
        )
    text = res.stdout.decode(errors="replace")
    if res.stdout_truncated:
        return CallOutcome(
            state="completed", **base, meta=meta, result=text + capped_note(res.stdout_bytes, len(res.stdout))
        )
    if not text.strip() and empty_result:
        return CallOutcome(state="completed", **base, result=empty_result)
    result, found = split_media(parse_output(text))
    return CallOutcome(state="completed", **base, result=result, media=found, meta=meta)
