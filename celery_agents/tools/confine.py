"""The sandbox's supervisor process: runs one tool confined, and leaves nothing of it behind.

Started by `sandbox.py` as `python -I -S confine.py CONFIG` (standard library only, so it starts
fast and imports nothing of the worker). It becomes a child subreaper, so every process the tool
starts stays its descendant even after a `setsid()`; forks the tool in a process group of its
own; in that child applies the rlimits and, when asked, drops to an unprivileged uid, then execs.
It enforces the wall-clock timeout (SIGTERM to the whole tree, SIGKILL after the grace period),
kills whatever is left once the tool exits, and writes one JSON status line to `status_fd`.

CONFIG (JSON): argv, limits ({"RLIMIT_AS": n or [soft, hard], ...}), nproc_extra (processes allowed beyond
those the uid already runs, when the uid is shared), uid, gid, timeout, grace, status_fd,
cgroup_procs (the `cgroup.procs` files of the run's cgroups, which the tool joins first), and
namespaces (where bubblewrap is not used: see `_isolate`).

Without bubblewrap, `namespaces` = {"user": bool, "network": bool, "workdir": DIR, "hide": [DIR...],
"keep": [PATH...]} puts the tool in new mount, pid, ipc and (unless `network`) network namespaces,
inside a user namespace of its own when the worker is not root: no network but loopback (Redis
included), a private `/tmp` and `/dev/shm`, every folder of `hide` (where other runs' directories
live) covered by an empty one except the run's own DIR and the paths of `keep` (the tool's files,
read-only), and a `/proc` that shows only the run's processes (not the worker's, not other runs').
The tool then runs below two small relays: the first stays in the worker's pid namespace and
reports the tool's exit status as its own, the second is pid 1 of the new namespace (it forwards
SIGTERM, and its exit kills whatever the tool left).
"""

import contextlib
import errno
import json
import os
import resource
import signal
import struct
import sys
import time
from typing import Any

_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 1
#: mount_setattr(2): the same number on every architecture (new system calls share one table)
_NR_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
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


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    kind = fstype.encode() if fstype else None
    options = data.encode() if data else None
    result = _libc().mount(source.encode(), target.encode(), kind, flags, options)
    _check(result, f"mount {fstype or source} on {target}")


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _private_mounts(ns: dict[str, Any]) -> None:
    """In the new mount namespace: nothing propagates back; /tmp, /dev/shm and the folder holding
    the runs' directories are empty but for the run's own directory (read-write) and the paths the
    tool needs that were in them (read-only)."""
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE)
    _read_only_everywhere()
    hidden = list(dict.fromkeys(["/tmp", "/dev/shm", *ns.get("hide", ())]))
    wanted = [(ns["workdir"], True)] + [(p, False) for p in ns.get("keep", ()) if os.path.exists(p)]
    kept = [
        (path, writable, os.open(path, os.O_PATH))
        for path, writable in sorted(wanted, key=lambda item: len(item[0]))
        if any(path == h or path.startswith(h.rstrip("/") + "/") for h in hidden)
    ]
    for folder in hidden:
        if os.path.isdir(folder):
            mode = "mode=1777" if folder in ("/tmp", "/dev/shm") else "mode=755"
            _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, mode)
    for path, writable, fd in kept:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        elif not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND)
        _mount("none", path, None, _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV | (0 if writable else _MS_RDONLY))
        os.close(fd)
    # The working directory still names the folder below the mounts: enter the one above.
    os.chdir(ns["workdir"])


def _read_only_everywhere() -> None:
    """Every mount the namespace inherited becomes read-only (`mount_setattr`, Linux 5.12+): the
    tool writes only its own directory, /tmp and /dev/shm (mounted afterwards). Older kernels
    lack the call: there the uid's permissions decide, as they would outside."""
    import ctypes

    attr = ctypes.create_string_buffer(struct.pack("QQQQ", _MOUNT_ATTR_RDONLY, 0, 0, 0))
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(
        ctypes.c_long(_NR_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), b"/", ctypes.c_uint(_AT_RECURSIVE), attr, 32
    )
    if result != 0 and ctypes.get_errno() != errno.ENOSYS:
        _check(int(result), "mount_setattr / read-only")


def _relay(pid: int, status_r: int) -> None:
    """The first relay: wait for pid 1 of the new namespace, then end as the tool ended."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the supervisor's SIGTERM is for the tool; SIGKILL still ends us
    _quiet()
    os.waitpid(pid, 0)
    data = os.read(status_r, 64).decode().strip()
    if not data:
        os._exit(126)
    code = int(data)
    if os.WIFSIGNALED(code):
        killer = os.WTERMSIG(code)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(killer, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [killer])
        os.kill(os.getpid(), killer)
    os._exit(os.waitstatus_to_exitcode(code) if os.WIFEXITED(code) else 128 + os.WTERMSIG(code))


def _quiet() -> None:
    """Let go of the tool's stdin and stdout: only the tool holds them."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)


def _init(tool: int, status_w: int) -> None:
    """Pid 1 of the new namespace: forward stop signals, reap, report the tool's status, leave
    (which kills every process left in the namespace)."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(-1, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    _quiet()
    while True:
        try:
            pid, code = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(126)
        except InterruptedError:
            continue
        if pid == tool:
            os.write(status_w, f"{code}\n".encode())
            os._exit(0)


def _isolate(ns: dict[str, Any]) -> None:
    """New namespaces for the tool (see the module docstring). Returns in the tool's own process;
    the relays never return."""
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC | (0 if ns.get("network") else _CLONE_NEWNET)
    if ns.get("user"):
        flags |= _CLONE_NEWUSER
    _check(_libc().unshare(flags), "unshare")
    if ns.get("user"):
        # The tool keeps its uid inside; it has no capability once it execs.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    status_r, status_w = os.pipe()
    pid = os.fork()
    # Neither relay may be ptraced by the tool: pid 1 holds every capability of the namespaces
    # (the tool's exec makes the tool dumpable again; nothing of ours is).
    _prctl(_PR_SET_DUMPABLE, 0)
    if pid:
        os.close(status_w)
        _relay(pid, status_r)
    os.close(status_r)
    _private_mounts(ns)
    if not ns.get("network"):
        _loopback_up()
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV)
    tool = os.fork()
    if tool:
        _init(tool, status_w)
    os.close(status_w)


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
            # The uid is shared with the worker: allow this many processes beyond its own (counted
            # here, where /proc still shows them all).
            # The namespaces' pid 1 is one more process of the uid.
            limits["RLIMIT_NPROC"] += _tasks_of_uid(os.getuid()) + (1 if cfg.get("namespaces") else 0)
        if cfg.get("namespaces"):
            try:
                _isolate(cfg["namespaces"])
            except OSError as exc:
                os.write(2, f"cannot create the run's namespaces: {exc}\n".encode())
                os._exit(126)
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
        _drop_and_exec(int(sys.argv[2]), sys.argv[3], sys.argv[5:])
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)
    status = _supervise(cfg)
    os.write(status_fd, (json.dumps(status) + "\n").encode())


def _drop_and_exec(uid: int, workdir: str, argv: list[str]) -> None:
    """`drop UID WORKDIR -- ARGV` (inside bubblewrap): become `uid` in `workdir`, then exec argv."""
    _default_signals()
    try:
        _drop_to(uid, uid)
        os.chdir(workdir)
    except OSError as exc:
        os.write(2, f"cannot become uid {uid} in {workdir}: {exc}\n".encode())
        os._exit(126)
    _exec(argv, uid)


def _supervise(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the tool as a child, wait for it within its timeout (or a stop signal), then end its
    whole tree; returns what happened (the status written on the status pipe)."""
    status: dict[str, Any] = {
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
    if main_pid > 0:
        _await_tool(main_pid, status, wake_r, time.monotonic() + float(cfg["timeout"]))
        _end_tree(main_pid, status, wake_r, float(cfg.get("grace", 1.0)))
    return status


def _await_tool(main_pid: int, status: dict[str, Any], wake_r: int, deadline: float) -> None:
    """Until the tool exits, the deadline passes, or the supervisor is told to stop."""
    while True:
        _reap(main_pid, status)
        if status["exit_status"] is not None:
            return
        if _flags["stop"]:
            status["stopped"] = True
            return
        left = deadline - time.monotonic()
        if left <= 0:
            status["timed_out"] = True
            return
        _wait(wake_r, min(left, 1.0))


def _end_tree(main_pid: int, status: dict[str, Any], wake_r: int, grace: float) -> None:
    """The tree goes: gently when the tool was stopped early, at once when it finished."""
    if status["timed_out"] or status["stopped"]:
        _signal_tree(main_pid, signal.SIGTERM)
        end = time.monotonic() + grace
        while _reap(main_pid, status) and time.monotonic() < end:
            _wait(wake_r, min(0.05, end - time.monotonic()))
    status["leftovers"] = _reap(main_pid, status)
    _signal_tree(main_pid, signal.SIGKILL)
    rounds_end = time.monotonic() + 10.0
    while _reap(main_pid, status) and time.monotonic() < rounds_end:
        _signal_tree(main_pid, signal.SIGKILL)
        _wait(wake_r, 0.01)


if __name__ == "__main__":
    main()
