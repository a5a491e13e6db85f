"""bubblewrap (`bwrap`) around a sandboxed run: the filesystem and the network hidden.

Inside, the tool sees the system's programs and libraries read-only (`/usr`, `/bin`, `/lib*`, a
few files of `/etc`), the paths it needs to run read-only (its script, the agent's folder, the
Python installation for python tools), an empty `/tmp`, its own working directory read-write,
fresh `/proc` and `/dev`, and no network but loopback unless the tool sets `"network": true`.
It lives in new pid, ipc, uts, cgroup and network namespaces (and a user namespace, unless the
worker is root: then bwrap keeps only CAP_SETUID/CAP_SETGID, for the sandbox to drop to its own
uid inside) and dies with its supervisor.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/mime.types",
)
_NETWORK_ETC = ("/etc/resolv.conf", "/etc/gai.conf", "/etc/host.conf")


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def bwrap_argv(bwrap: str, workdir: str, readable: Iterable[str], network: bool, as_root: bool) -> list[str]:
    """The `bwrap ... --` prefix of the tool's argv. As root, the working directory is entered by
    the drop helper inside (only the run's uid may enter it)."""
    argv = [bwrap, "--die-with-parent", "--new-session"]
    if as_root:
        # A user namespace would map root to root and forbid the drop to the run's own uid.
        argv += [
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--cap-drop",
            "ALL",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
        ]
        if not network:
            argv.append("--unshare-net")
    else:
        argv.append("--unshare-all")
        if network:
            argv.append("--share-net")
    for path in (*_SYSTEM, *_ETC, *(_NETWORK_ETC if network else ())):
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
    bound = [p for p in _SYSTEM if os.path.exists(p)] + ["/tmp"]
    made: set[str] = set()
    wanted = sorted(
        {os.path.realpath(p) for p in readable if os.path.exists(p)}
        | {p for p in readable if os.path.isabs(p) and os.path.exists(p)},
        key=len,
    )

    def parents(path: str) -> list[str]:
        # bwrap gives the folders it creates the mode of the originals (a 0700 /root would hide a
        # Python installed under it from the run's uid): create them searchable first.
        out = []
        for parent in reversed(Path(path).parents):
            name = str(parent)
            if (
                name not in ("/", "/tmp")
                and name not in made
                and not any(_within(name, b) for b in bound if b != "/tmp")
            ):
                made.add(name)
                out += ["--perms", "0755", "--dir", name]
        return out

    for path in wanted:
        if path == "/" or any(_within(path, b) for b in bound if b != "/tmp"):
            continue
        argv += [*parents(path), "--ro-bind", os.path.realpath(path), path]
        bound.append(path)
    argv += [*parents(workdir), "--bind", workdir, workdir]
    if not as_root:
        argv += ["--chdir", workdir]
    return [*argv, "--"]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
