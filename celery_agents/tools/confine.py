"""The sandbox's supervisor process: runs one tool confined, and leaves nothing of it behind.

Started by `sandbox.py` as `python -I -S confine.py CONFIG` (standard library only, so it starts
fast and imports nothing of the worker). It becomes a child subreaper, so every process the tool
starts stays its descendant even after a `setsid()`; forks the tool in a process group of its
own; in that child applies the rlimits and, when asked, drops to an unprivileged uid, then execs.
It enforces the wall-clock timeout (SIGTERM to the whole tree, SIGKILL after the grace period),
kills whatever is left once the tool exits, and writes one JSON status line to `status_fd`.

CONFIG (JSON): argv, limits ({"RLIMIT_AS": n or [soft, hard], ...}), nproc_extra (processes allowed beyond
those the uid already runs, when the uid is shared), uid, gid, timeout, grace, status_fd, and
cgroup_procs (the `cgroup.procs` files of the run's cgroups, which the tool joins first).

`confine.py drop UID DIR -- ARGV...` only drops to UID, enters DIR and execs ARGV: under
bubblewrap started by root, the drop happens inside, where the tool's files are reachable whatever
their parents' modes (and DIR, the run's own directory, only by UID).
"""

import contextlib
import json
import os
import resource
import signal
import sys
import time
from typing import Any

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_flags = {"stop": False}


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _become_subreaper() -> bool:
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _drop_to(uid: int, gid: int) -> None:
    """Become `uid` for good: no groups, no capabilities, and no setuid program can give them back."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _exec(argv: list[str], uid: object) -> None:
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        hint = ""
        if exc.errno == 13 and uid is not None:
            hint = f" (the tool runs as uid {uid}: its files and their folders must be readable by others)"
        os.write(2, f"cannot start {argv[0]!r}: {exc.strerror or exc}{hint}\n".encode())
        os._exit(127)


def _default_signals() -> None:
    # Python ignores SIGPIPE and SIGXFSZ; the tool must get the defaults (SIGXFSZ enforces the
    # file size limit).
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)


def _tasks_of_uid(uid: int) -> int:
    """Threads (the unit RLIMIT_NPROC counts) of every process of `uid`."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


def _exec_tool(cfg: dict[str, Any]) -> None:
    """In the forked child: confine, then become the tool. Never returns."""
    try:
        os.setpgid(0, 0)
        _default_signals()
        signal.set_wakeup_fd(-1)
        for procs in cfg.get("cgroup_procs") or ():
            # The run's cgroup, joined before anything else runs: the tool's whole tree is in it.
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        limits = dict(cfg.get("limits") or {})
        uid = cfg.get("uid")
        if "RLIMIT_NPROC" in limits and cfg.get("nproc_extra"):
            # The uid is shared with the worker: allow this many processes beyond its own.
            limits["RLIMIT_NPROC"] = limits["RLIMIT_NPROC"] + _tasks_of_uid(os.getuid())
        for name, value in limits.items():
            which = getattr(resource, name)
            soft, hard = (value, value) if isinstance(value, int) else value
            _, current = resource.getrlimit(which)
            if current != resource.RLIM_INFINITY and os.geteuid() != 0:
                soft, hard = min(soft, current), min(hard, current)
            resource.setrlimit(which, (soft, hard))
        if uid is not None:
            _drop_to(uid, cfg.get("gid", uid))
        _exec(cfg["argv"], uid)
    except BaseException as exc:  # never let the child run the supervisor's code
        os.write(2, f"cannot start {cfg['argv'][0]!r}: {exc}\n".encode())
        os._exit(127)


def _children() -> list[int]:
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry))
    return found


def _signal_tree(pgid: int, sig: int) -> None:
    """Signal the tool's group and every child of ours (orphans of the tool come to us)."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, sig)
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _reap(main: int, status: dict[str, Any]) -> bool:
    """Reap every exited child; True while any child remains."""
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == main:
            status["exit_status"] = os.waitstatus_to_exitcode(code)


def _wait(wake: int, seconds: float) -> None:
    import select

    try:
        ready, _, _ = select.select([wake], [], [], max(0.0, seconds))
    except InterruptedError:
        return
    if ready:
        with contextlib.suppress(BlockingIOError):
            os.read(wake, 4096)


def _on_stop(signum: int, frame: object) -> None:
    _flags["stop"] = True


def main() -> None:
    if sys.argv[1] == "drop":
        uid = int(sys.argv[2])
        _default_signals()
        try:
            _drop_to(uid, uid)
            os.chdir(sys.argv[3])
        except OSError as exc:
            os.write(2, f"cannot become uid {uid} in {sys.argv[3]}: {exc}\n".encode())
            os._exit(126)
        _exec(sys.argv[5:], uid)
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)
    status = {
        "exit_status": None,
        "timed_out": False,
        "stopped": False,
        "leftovers": False,
        "subreaper": _become_subreaper(),
    }
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_stop)
    try:
        main_pid = os.fork()
    except OSError as exc:
        os.write(2, f"cannot start the tool: {exc}\n".encode())
        main_pid = -1
    if main_pid == 0:
        _exec_tool(cfg)
    os.close(0)
    deadline = time.monotonic() + float(cfg["timeout"])
    while main_pid > 0:
        _reap(main_pid, status)
        if status["exit_status"] is not None:
            break
        if _flags["stop"]:
            status["stopped"] = True
            break
        left = deadline - time.monotonic()
        if left <= 0:
            status["timed_out"] = True
            break
        _wait(wake_r, min(left, 1.0))
    # The tree goes: gently when the tool was stopped early, at once when it finished.
    if status["timed_out"] or status["stopped"]:
        _signal_tree(main_pid, signal.SIGTERM)
        end = time.monotonic() + float(cfg.get("grace", 1.0))
        while _reap(main_pid, status) and time.monotonic() < end:
            _wait(wake_r, min(0.05, end - time.monotonic()))
    if main_pid > 0:
        status["leftovers"] = _reap(main_pid, status)
        _signal_tree(main_pid, signal.SIGKILL)
    rounds_end = time.monotonic() + 10.0
    while main_pid > 0 and _reap(main_pid, status) and time.monotonic() < rounds_end:
        _signal_tree(main_pid, signal.SIGKILL)
        _wait(wake_r, 0.01)
    os.write(status_fd, (json.dumps(status) + "\n").encode())


if __name__ == "__main__":
    main()
