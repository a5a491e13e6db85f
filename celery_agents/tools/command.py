"""Command tools: argv run as a child process, arguments as a JSON object on stdin, result on stdout.

A non-zero exit is a failed call with stderr as its error. A command that outlives its timeout is
killed with its whole process group (SIGTERM, then SIGKILL after a short grace).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ProcessResult:
    exit_status: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration_ms: float
    stdout_truncated: bool = False


def resolve_argv(argv: list[str], base_dir: str | None) -> list[str]:
    """Relative paths that exist under the agent file's folder become absolute."""
    if not base_dir:
        return list(argv)
    out = []
    for arg in argv:
        if not os.path.isabs(arg) and not arg.startswith("-"):
            candidate = Path(base_dir) / arg
            if ("/" in arg or arg == argv[0]) and candidate.exists():
                out.append(str(candidate))
                continue
        out.append(arg)
    return out


def kill_group(proc: subprocess.Popen[bytes], grace: float = 1.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `grace` seconds."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; children in the group may linger: SIGKILL them.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def run_process(argv: list[str], stdin: bytes, *, env: dict[str, str], cwd: str | None, timeout: float,
                output_cap: int, preexec: Any = None) -> ProcessResult:
    """Run argv in its own session (process group) with a wall-clock timeout and an output cap."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=cwd, start_new_session=True, preexec_fn=preexec)
    except (FileNotFoundError, PermissionError, OSError) as exc:
        return ProcessResult(None, b"", f"cannot start {argv[0]!r}: {exc}".encode(), False,
                             (time.monotonic() - started) * 1000)
    timed_out = False
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        out, err = proc.communicate()
    else:
        # Children the tool left behind in its group must not outlive the call.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    truncated = len(out) > output_cap
    return ProcessResult(proc.returncode, out[:output_cap], err[-output_cap:], timed_out,
                         (time.monotonic() - started) * 1000, truncated)
