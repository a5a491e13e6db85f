"""Running a worker the way a deployment might: as an unprivileged user, or where no namespace
can be created. Root only (the test machine); each helper returns an argv prefix for `Worker`.

`python -m tests.support.confinement no-namespaces ARGV...` execs ARGV under a seccomp filter that
refuses `unshare` (and `clone` with namespace flags): a machine whose kernel allows no namespaces.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

TEST_USER = "agents-sbx"
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_AUDIT_ARCH_X86_64, _NR_CLONE, _NR_UNSHARE, _NR_CLONE3 = 0xC000003E, 56, 272, 435
_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_EPERM, _ENOSYS = 1, 38


def unprivileged_user() -> tuple[int, int] | None:
    """(uid, gid) of a user with no privileges, created when missing; None where the test cannot."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    try:
        found = pwd.getpwnam(TEST_USER)
    except KeyError:
        if not shutil.which("useradd"):
            return None
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
            capture_output=True,
        )
        if made.returncode not in (0, 9):  # 9: created meanwhile by another test run
            return None
        found = pwd.getpwnam(TEST_USER)
    return found.pw_uid, found.pw_gid


def as_user(uid: int, gid: int) -> list[str]:
    """An argv prefix running the rest as uid/gid with no groups and no capabilities. The
    interpreter may live under a 0700 folder (pyenv under /root): in a mount namespace of the
    worker's own, that folder is replaced by a searchable one holding only the interpreter's tree."""
    python_root = Path(sys.base_prefix)
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all", "--"]
    hidden = next((p for p in reversed(python_root.parents) if str(p) != "/" and not os.stat(p).st_mode & 0o001), None)
    if hidden is None:
        return prefix
    top = python_root.relative_to(hidden).parts[0]
    stage = tempfile.mkdtemp(prefix="agents-stage-")
    script = (
        f'mount --bind "{hidden / top}" "{stage}" && mount -t tmpfs -o mode=755 tmpfs "{hidden}" && '
        f'mkdir "{hidden / top}" && mount --move "{stage}" "{hidden / top}" && rmdir "{stage}" && exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *prefix]


def without_namespaces() -> list[str]:
    """An argv prefix running the rest where no namespace can be created."""
    return [sys.executable, "-m", "tests.support.confinement", "no-namespaces"]


def _filter() -> bytes:
    def stmt(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    ld_w_abs, jeq_k, jset_k, ret_k = 0x20, 0x15, 0x45, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | _EPERM
    return b"".join(
        [
            stmt(ld_w_abs, 4),  # arch
            stmt(jeq_k, _AUDIT_ARCH_X86_64, 1, 0),
            stmt(ret_k, allow),
            stmt(ld_w_abs, 0),  # syscall number
            stmt(jeq_k, _NR_UNSHARE, 4, 0),
            stmt(jeq_k, _NR_CLONE3, 5, 0),
            stmt(jeq_k, _NR_CLONE, 0, 3),
            stmt(ld_w_abs, 16),  # clone's flags (low 32 bits)
            stmt(jset_k, _NAMESPACE_FLAGS, 0, 1),
            stmt(ret_k, deny),
            stmt(ret_k, allow),
            # clone3's flags are in memory, out of the filter's sight: "not implemented" makes libc
            # fall back to clone, whose flags it sees.
            stmt(ret_k, 0x00050000 | _ENOSYS),
        ]
    )


def _exec_without_namespaces(argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    program = _filter()
    buf = ctypes.create_string_buffer(program)
    fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fbuf), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    if sys.argv[1] == "no-namespaces":
        _exec_without_namespaces(sys.argv[2:])
