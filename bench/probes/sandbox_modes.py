"""Measure what a runIsolated call can reach in each worker mode: root or an unprivileged user,
with bubblewrap or without it. Prints the table of docs/security.md ("Sandbox").

    python bench/probes/sandbox_modes.py            # as root: all four modes (makes a test user)
    python bench/probes/sandbox_modes.py --json

Each mode runs in a process of its own (as the user, for the unprivileged modes) holding a
secret in its environment, next to a listener standing in for Redis (127.0.0.1) and one on the
machine's own address (the network), and a directory of another run holding a file. A hostile
tool then tries each of them; ten trivial runs give the cost per call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-measure-worker-secret"
PROBE = r"""
import json, os, socket, sys
redis_port, net_host, net_port, neighbour, secret, shared, sock = sys.argv[1:8]
def connect(host, port):
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return "reachable"
    except OSError as exc:
        return "cut (" + (exc.strerror or type(exc).__name__) + ")"
hits = 0
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            hits += secret.encode() in open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            pass
try:
    other = "readable: " + open(os.path.join(neighbour, "secret.txt")).read()
except OSError as exc:
    other = "unreachable (" + (exc.strerror or type(exc).__name__) + ")"
try:
    open(os.path.join(shared, "dropped"), "w").write("x")
    wrote = "written"
except OSError as exc:
    wrote = "refused (" + (exc.strerror or type(exc).__name__) + ")"
try:
    unix = socket.socket(socket.AF_UNIX)
    unix.connect(sock)
    redis_unix = "reachable"
except OSError as exc:
    redis_unix = "cut (" + (exc.strerror or type(exc).__name__) + ")"
print(json.dumps({"uid": os.getuid(), "redis": connect("127.0.0.1", redis_port), "redis_unix": redis_unix,
                  "write_shared": wrote,
                  "network": connect(net_host, net_port), "environ": hits, "other_run": other}))
"""


def measure_one(bwrap: str, redis_port: int, net_host: str, net_port: int, root: str) -> dict[str, object]:
    """In the mode's own process: one hostile run, then ten trivial ones."""
    from celery_agents.tools.sandbox import Sandbox, SandboxConfig, SandboxUnavailable

    # The worker's Redis listens on a unix socket too (AGENTS_REDIS_URL names it).
    sockets = tempfile.mkdtemp(prefix="agents-redis-", dir="/var/tmp")
    os.chmod(sockets, 0o755)
    sock = os.path.join(sockets, "redis.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock)
    os.chmod(sock, 0o777)
    listener.listen(4)
    os.environ["AGENTS_REDIS_URL"] = f"unix://{sock}"
    os.environ["AGENTS_SANDBOX_BWRAP"], os.environ["AGENTS_SANDBOX_DIR"] = bwrap, root
    box = Sandbox(SandboxConfig.from_env())
    shared = tempfile.mkdtemp(prefix="agents-shared-", dir="/var/tmp")  # writable by every user
    os.chmod(shared, 0o1777)
    neighbour = tempfile.mkdtemp(prefix="agents-sandbox-", dir=root)
    Path(neighbour, "secret.txt").write_text("another session's file")
    if os.geteuid() == 0:
        os.chown(neighbour, 200_000_001, 200_000_001)  # another run's own uid
    argv = ["/usr/bin/python3", "-c", PROBE, str(redis_port), net_host, str(net_port), neighbour, SECRET, shared, sock]
    out: dict[str, object] = {"containment": box.containment(), "run_cgroup": box.cgroups.available()}
    try:
        run = box.run(argv, b"", call_env={}, timeout=30, needs=["/usr/bin/python3"])
    except SandboxUnavailable as exc:
        return {**out, "refused": str(exc)}
    finally:
        listener.close()
        subprocess.run(["rm", "-rf", sockets, shared])
    out.update(json.loads(run.process.stdout or b"{}"))
    out["memory_scope"] = run.meta["memory_scope"]
    times = []
    for _ in range(10):
        started = time.perf_counter()
        box.run(["/bin/true"], b"", call_env={}, timeout=30, needs=["/bin/true"])
        times.append((time.perf_counter() - started) * 1000)
    out["ms_per_call"] = round(sorted(times)[len(times) // 2], 1)
    return out


def _listener(host: str) -> socket.socket:
    server = socket.create_server((host, 0))
    server.listen(16)
    return server


def _own_address() -> str:
    """An address of this machine other than loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        return str(s.getsockname()[0])


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tests.support.confinement import as_user, unprivileged_user

    redis_like, net = _listener("127.0.0.1"), _listener(_own_address())
    rows = {}
    for who in ("root", "user"):
        user = unprivileged_user() if who == "user" else None
        if who == "user" and user is None:
            continue
        for bwrap in ("auto", "off"):
            root = tempfile.mkdtemp(prefix="agents-measure-")
            os.chmod(root, 0o755)
            if user is not None:
                os.chown(root, *user)
            args = [str(redis_like.getsockname()[1]), net.getsockname()[0], str(net.getsockname()[1]), root]
            prefix = as_user(*user) if user is not None else []
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_API_KEY": SECRET, "HOME": root}
            proc = subprocess.run(
                [*prefix, sys.executable, __file__, "--one", bwrap, *args], env=env, capture_output=True, text=True
            )
            key = f"{who}, {'bubblewrap' if bwrap == 'auto' else 'AGENTS_SANDBOX_BWRAP=off'}"
            rows[key] = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
            subprocess.run(["rm", "-rf", root])
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=2))
        return
    for key, row in rows.items():
        print(f"{key}: {json.dumps(row)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        bwrap, redis_port, net_host, net_port, root = sys.argv[2:7]
        print(json.dumps(measure_one(bwrap, int(redis_port), net_host, int(net_port), root)))
    else:
        main()
