"""The runIsolated sandbox against tools that misbehave on purpose, at each level (namespaces of
its own without bubblewrap, and bubblewrap where it works): each attempt is contained and
reported, and the test process (the worker) stays healthy."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_agents.tools import Sandbox, SandboxConfig, ToolRunner
from celery_agents.tools.sandbox import reachable_by_others
from tests.tools.conftest import PY, alive_as, alive_with, make_agent, run_tool, write_program

_RLIMITS = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_NPROC")


@pytest.fixture(autouse=True)
def worker_stays_healthy() -> Iterator[None]:
    """After every test: this process's own limits are untouched and it can still start processes."""
    before = {name: resource.getrlimit(getattr(resource, name)) for name in _RLIMITS}
    yield
    assert {name: resource.getrlimit(getattr(resource, name)) for name in _RLIMITS} == before
    assert subprocess.run([PY, "-c", "print('alive')"], capture_output=True, timeout=30).stdout == b"alive\n"


def tool(name: str, code: str, marker: str = "", **extra: object) -> dict[str, object]:
    return {"name": name, "command": [PY, "-c", code, marker or name], **extra}


def own_uid_possible() -> bool:
    return os.geteuid() == 0 and reachable_by_others(PY)


def test_the_worker_secrets_are_not_in_the_tool_environment(
    isolated: ToolRunner, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTS_REDIS_URL", "redis://:hunter2@10.0.0.1:6379/0")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-worker-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-worker-secret")
    monkeypatch.setenv("WEATHER_API_KEY", "wk-granted")
    agent = make_agent(
        [
            tool(
                "env",
                "import json, os; print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd()}))",
                env=["WEATHER_API_KEY"],
            )
        ]
    )
    out = run_tool(isolated, agent, "env", session_id="s-env", call_id="call_env")
    assert out.state == "completed", out.error
    env = out.result["env"]
    assert not {"AGENTS_REDIS_URL", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert "hunter2" not in str(out.result) and "worker-secret" not in str(out.result)
    assert env["WEATHER_API_KEY"] == "wk-granted", "a variable the tool names in env is passed"
    assert (env["AGENTS_SESSION_ID"], env["AGENTS_CALL_ID"]) == ("s-env", "call_env")
    assert env["HOME"] == out.result["cwd"] == env["TMPDIR"]
    assert not os.path.exists(out.result["cwd"]), "the run's directory is removed afterwards"
    assert out.meta.isolation == level


def test_writing_outside_its_directory_is_refused(isolated: ToolRunner, level: str, tooldir: Path) -> None:
    victim = tooldir / "worker-data.txt"
    victim.write_text("precious")
    victim.chmod(0o644)
    escape = Path("/tmp") / f"agents-escape-{uuid.uuid4().hex}"
    agent = make_agent(
        [
            tool("overwrite", f"open({str(victim)!r}, 'w').write('pwned')"),
            tool("create", f"open({str(tooldir / 'planted.txt')!r}, 'w').write('pwned')"),
            tool("home", "import os; open(os.path.expanduser('~/kept.txt'), 'w').write('x'); print(os.getcwd())"),
            tool("tmp", f"open({str(escape)!r}, 'w').write('x')"),
        ]
    )
    for name in ("overwrite", "create"):
        out = run_tool(isolated, agent, name)
        assert out.state == "failed" and (
            "Permission denied" in out.error or "Read-only file system" in out.error or "No such file" in out.error
        ), out.error
    assert victim.read_text() == "precious" and not (tooldir / "planted.txt").exists()
    home = run_tool(isolated, agent, "home")
    assert home.state == "completed" and not os.path.exists(home.result), "its own files go with its directory"
    out = run_tool(isolated, agent, "tmp")
    assert out.state == "completed", out.error
    assert not escape.exists(), "/tmp is the run's own"
    shared = Path(tempfile.mkdtemp(prefix="agents-shared-", dir="/var/tmp"))
    shared.chmod(0o1777)  # a folder every user may write, outside /tmp
    try:
        drop = make_agent([tool("drop", f"open({str(shared / 'dropped')!r}, 'w').write('x')")])
        out = run_tool(isolated, drop, "drop")
        # Read-only without bubblewrap; not even there under it.
        assert out.state == "failed" and ("Read-only" in (out.error or "") or "No such file" in (out.error or ""))
        assert not (shared / "dropped").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_allocating_past_the_memory_limit_fails_the_call(isolated: ToolRunner) -> None:
    agent = make_agent([tool("hog", "b = bytearray(1024 * 1024 * 1024); print(len(b))", limits={"memoryMb": 256})])
    out = run_tool(isolated, agent, "hog")
    assert out.state == "failed" and "MemoryError" in out.error
    assert out.meta.limits["memoryMb"] == 256


def test_a_fork_bomb_is_capped_and_killed_at_the_timeout(isolated: ToolRunner, level: str) -> None:
    if os.geteuid() == 0 and not own_uid_possible() and level == "namespaces":
        pytest.skip("a root worker could not give this interpreter its own uid: the process limit would not hold")
    marker = f"bomb-{uuid.uuid4().hex}"
    code = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
    agent = make_agent(
        [tool("bomb", code, marker, limits={"processes": 24})],
        rules=[{"tool": "bomb", "disposition": {"tag": "runIsolated", "timeoutSeconds": 2}}],
    )
    started = time.monotonic()
    out = run_tool(isolated, agent, "bomb")
    assert out.state == "failed" and out.meta.timed_out and "did not finish within 2 s" in out.error
    assert time.monotonic() - started < 2 + 1 + 5 + 5
    assert alive_with(marker) == [], "every process of the bomb is gone"
    if out.meta.uid is not None:
        assert alive_as(int(out.meta.uid)) == []


def test_forking_stops_at_the_process_limit(isolated: ToolRunner, level: str) -> None:
    if os.geteuid() == 0 and not own_uid_possible() and level == "namespaces":
        pytest.skip("a root worker could not give this interpreter its own uid: the process limit would not hold")
    marker = f"forks-{uuid.uuid4().hex}"
    code = (
        "import os, time\n"
        "n = 0\n"
        "while n < 1000:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(600)\n"
        "    n += 1\n"
        "print(n)\n"
    )
    agent = make_agent([tool("forks", code, marker, limits={"processes": 20})])
    out = run_tool(isolated, agent, "forks")
    assert out.state == "completed", out.error
    assert 0 < out.result < 20 + 8, "the kernel refused forks past the limit (a shared uid allows a little slack)"
    assert alive_with(marker) == [], "the children it left are killed when it exits"


def test_past_its_timeout_the_whole_tree_dies_even_what_ignores_sigterm_or_left_the_group(
    isolated: ToolRunner, tooldir: Path
) -> None:
    marker = f"stubborn-{uuid.uuid4().hex}"
    write_program(
        tooldir,
        "stubborn.py",
        """
        import os, subprocess, sys, time
        marker = sys.argv[1]
        subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)", marker])
        subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)", marker])
        time.sleep(600)
    """,
    )
    agent = make_agent(
        [{"name": "stubborn", "command": [PY, str(tooldir / "stubborn.py"), marker]}],
        rules=[{"tool": "stubborn", "disposition": {"tag": "runIsolated", "timeoutSeconds": 1}}],
    )
    out = run_tool(isolated, agent, "stubborn")
    assert out.state == "failed" and out.meta.timed_out
    assert "did not finish within 1 s and was killed" in out.error
    assert alive_with(marker) == []


def test_a_busy_loop_stops_at_its_cpu_limit(isolated: ToolRunner) -> None:
    agent = make_agent([tool("spin", "while True: pass", limits={"cpuSeconds": 1})])
    out = run_tool(isolated, agent, "spin")
    assert out.state == "failed" and not out.meta.timed_out
    assert "CPU time limit" in out.error or "killed by SIGKILL" in out.error, out.error


def test_a_file_past_the_size_limit_is_refused(isolated: ToolRunner) -> None:
    agent = make_agent([tool("fill", "open('big.bin', 'wb').write(b'x' * 5 * 1024 * 1024)", limits={"fileSizeMb": 1})])
    out = run_tool(isolated, agent, "fill")
    assert out.state == "failed" and ("File too large" in out.error or "file size limit" in out.error), out.error


def test_too_many_open_files_are_refused(isolated: ToolRunner) -> None:
    agent = make_agent([tool("files", "fs = [open(f'f{i}', 'w') for i in range(200)]", limits={"openFiles": 32})])
    out = run_tool(isolated, agent, "files")
    assert out.state == "failed" and "Too many open files" in out.error


def test_a_flood_of_output_is_capped_without_filling_the_worker(isolated: ToolRunner) -> None:
    agent = make_agent(
        [tool("flood", "import sys\nfor _ in range(400): sys.stdout.write('w' * 65536)", limits={"outputBytes": 2000})]
    )
    out = run_tool(isolated, agent, "flood")
    assert out.state == "completed"
    assert out.result.startswith("w" * 2000) and "the tool wrote 26214400 bytes; only the first 2000" in out.result
    assert out.meta.output_capped == {"written": 26214400, "cap": 2000}


def test_a_root_worker_runs_each_tool_under_a_uid_of_its_own(isolated: ToolRunner, level: str) -> None:
    if not own_uid_possible() and not (os.geteuid() == 0 and level == "bwrap"):
        pytest.skip("only a root worker changes the tool's uid")
    agent = make_agent([tool("uid", "import os; print(os.getuid())")])
    first, second = run_tool(isolated, agent, "uid"), run_tool(isolated, agent, "uid")
    assert first.result != 0 and first.result == first.meta.uid
    assert second.result != first.result


def test_the_network_is_cut_unless_the_tool_or_its_rule_asks_for_it(isolated: ToolRunner, level: str) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:  # stands in for the worker's Redis
        port = server.getsockname()[1]
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')"
        agent = make_agent(
            [tool("cut", code), tool("allowed", code, network=True), tool("by_rule", code)],
            rules=[{"tool": "by_rule", "disposition": {"tag": "runIsolated", "network": True}}],
        )
        cut = run_tool(isolated, agent, "cut")
        assert cut.state == "failed" and "Connection refused" in (cut.error or ""), (cut.state, cut.error)
        for name in ("allowed", "by_rule"):
            allowed = run_tool(isolated, agent, name)
            assert allowed.state == "completed" and allowed.result == "connected", allowed.error


def test_a_redis_unix_socket_is_out_of_reach_too(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A network namespace does not cut unix sockets: the folder of the worker's Redis socket (and
    its AGENTS_HOME, where the embedded Redis listens) is hidden from the run."""
    import socket

    folder = Path(tempfile.mkdtemp(prefix="agents-redis-", dir="/var/tmp"))
    folder.chmod(0o755)
    path = folder / "redis.sock"
    monkeypatch.setenv("AGENTS_REDIS_URL", f"unix://{path}?db=0")
    monkeypatch.setenv("AGENTS_SANDBOX_BWRAP", "require" if level == "bwrap" else "off")
    runner = ToolRunner(isolated=True, sandbox=Sandbox(SandboxConfig.from_env()))
    code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(path)!r}); print('connected')"
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            path.chmod(0o777)  # any uid may connect: only the sandbox stands in the way
            server.listen(4)
            out = run_tool(runner, make_agent([tool("unix", code)]), "unix")
        assert out.state == "failed" and "No such file" in (out.error or ""), (out.state, out.result, out.error)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


FORKING_HOG = """
import os, sys
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(150 * 1024 * 1024)  # within the per-process limit; touched, so resident
        for i in range(0, len(block), 4096):
            block[i] = 1
        os._exit(0)
    children.append(pid)
codes = [os.waitpid(pid, 0)[1] for pid in children]
print("children ended with", codes)
"""


def test_children_together_cannot_go_past_the_memory_limit(isolated: ToolRunner, level: str) -> None:
    if not isolated.sandbox.cgroups.available():
        pytest.skip("this worker cannot create cgroups (not root, or no writable memory/pids hierarchy)")
    agent = make_agent([tool("forking-hog", FORKING_HOG, limits={"memoryMb": 256})])
    without = ToolRunner(
        isolated=True, sandbox=Sandbox(SandboxConfig(bwrap="require" if level == "bwrap" else "off", cgroup="off"))
    )
    unbounded = run_tool(without, agent, "forking-hog")
    assert unbounded.state == "completed" and unbounded.meta.memory_scope == "process", (
        "per-process limits alone let 4 x 150 MB through: the gap the cgroup closes"
    )
    out = run_tool(isolated, agent, "forking-hog")
    assert out.state == "failed", out.result
    assert out.error.startswith("out of memory: the run's processes together went past memoryMb=256"), out.error
    assert out.meta.memory_scope == "run" and out.meta.oom_kills >= 1
    # The limit is the run's alone: the next run starts afresh and its cgroup is gone afterwards.
    ok = run_tool(isolated, make_agent([tool("small", "print(len(bytearray(100 * 1024 * 1024)))")]), "small")
    assert ok.state == "completed" and ok.result == 104857600 and "oom_kills" not in ok.meta, ok.error
    assert isolated.sandbox.cgroups.leftovers() == []


def test_a_limit_of_one_process_still_runs_the_tool(isolated: ToolRunner, level: str) -> None:
    agent = make_agent(
        [tool("single", "print('alone')", limits={"processes": 1}), tool("forks", _FORK_ONCE, limits={"processes": 1})]
    )
    out = run_tool(isolated, agent, "single")
    assert out.state == "completed" and out.result == "alone", (out.error, out.meta)
    forked = run_tool(isolated, agent, "forks")
    if forked.meta.memory_scope == "run":  # the cgroup counts the run's processes: no second one
        assert forked.state == "completed" and forked.result == "refused", (forked.error, forked.meta)


_FORK_ONCE = """
import os
try:
    pid = os.fork()
except OSError:
    print("refused")
else:
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    print("forked")
"""


def test_without_bubblewrap_the_tool_cannot_look_into_the_sandbox_s_own_processes(level: str) -> None:
    """Pid 1 of the run's namespaces holds their capabilities: the tool must not ptrace it."""
    if level != "namespaces":
        pytest.skip("bubblewrap's own init is bubblewrap's business")
    runner = ToolRunner(isolated=True, sandbox=Sandbox(SandboxConfig(bwrap="off")))
    code = (
        "import json, os\nout = {}\nfor name in ('environ', 'mem', 'root/'):\n"
        "    try:\n        os.listdir('/proc/1/root') if name == 'root/' else open('/proc/1/' + name, 'rb').read(1)\n"
        "        out[name] = 'open'\n    except OSError as exc:\n        out[name] = exc.strerror\n"
        "print(json.dumps({'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), **out}))"
    )
    out = run_tool(runner, make_agent([tool("peek1", code)]), "peek1")
    assert out.state == "completed", out.error
    assert out.result["pids"] == [1, 2], "the run sees its own processes only (pid 1 and itself)"
    assert {out.result[k] for k in ("environ", "mem", "root/")} == {"Permission denied"}, out.result


PROTECTED = """
import os, subprocess, sys
from celery_agents.tools.sandbox import protect_process
def peek(pid):
    # A program of the same uid (exec makes it an ordinary process) reading the environment.
    return subprocess.run(["cat", f"/proc/{pid}/environ"], capture_output=True).returncode
before = peek(os.getpid())
protect_process()
pid = os.fork()
if pid == 0:
    os.read(0, 1)
    os._exit(0)
print(before, peek(os.getpid()), peek(pid))
"""


def test_a_process_of_the_worker_s_user_cannot_read_the_worker_s_environment(tmp_path: Path) -> None:
    from tests.support.confinement import as_user, unprivileged_user

    user = unprivileged_user()
    if user is None:
        pytest.skip("needs root to run a process as an unprivileged user")
    script = Path(tempfile.mkdtemp(prefix="agents-protect-")) / "protected.py"
    script.parent.chmod(0o755)
    script.write_text(PROTECTED)
    script.chmod(0o644)
    env = {**os.environ, "OPENAI_API_KEY": "sk-protected", "PYTHONPATH": str(Path(__file__).parents[2])}
    try:
        out = subprocess.run(
            [*as_user(*user), sys.executable, str(script)], env=env, input=b"x", capture_output=True, timeout=60
        )
    finally:
        shutil.rmtree(script.parent, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    before, worker, pool_process = out.stdout.decode().split()
    assert before == "0", "an unprotected process's environment is readable by its own uid"
    assert (worker, pool_process) == ("1", "1"), "the worker and what it forks are not"
