"""The contract's Redis URLs on a Redis that wants them: a password (`redis://:PW@`), an ACL user
(`redis://USER:PW@`), and TLS (`rediss://`, the server's certificate checked against a CA): a
session runs through a real worker and through the CLI inline, a completion arrives by XADD, and
no password is ever stored in Redis or printed."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from tests.cli.process import DEMO_AGENT, agents, cli_env, poll
from tests.support.redis_server import free_port
from tests.support.workers import Worker, worker_env

ADMIN_PW = f"adm-{uuid.uuid4().hex[:12]}"
USER_PW = f"usr-{uuid.uuid4().hex[:12]}"
SECRETS = (ADMIN_PW, USER_PW)


def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, and a certificate for 127.0.0.1 signed by it."""
    ca_key, ca_crt = folder / "ca.key", folder / "ca.crt"
    key, csr, crt = folder / "redis.key", folder / "redis.csr", folder / "redis.crt"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1\n")

    def ssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_crt,
        "-days", "2", "-subj", "/CN=celery-agents test CA")  # fmt: skip
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    ssl("x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
        "-days", "2", "-extfile", ext)  # fmt: skip
    return {"ca": ca_crt, "cert": crt, "key": key}


@dataclass
class SecuredRedis:
    port: int
    tls_port: int
    ca: Path

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=ADMIN_PW, decode_responses=True)

    def password_url(self) -> str:
        return f"redis://:{quote(ADMIN_PW)}@127.0.0.1:{self.port}/0"

    def tls_acl_url(self) -> str:
        return (
            f"rediss://agents:{quote(USER_PW)}@127.0.0.1:{self.tls_port}/0"
            f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(self.ca))}"
        )


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredRedis]:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make certificates")
    folder = tmp_path_factory.mktemp("secured-redis")
    certs = _certificates(folder)
    acl = folder / "users.acl"
    acl.write_text(
        f"user default on >{ADMIN_PW} ~* &* +@all\n"
        # What celery-agents and its Celery broker need: every key and channel, every command but
        # the administrative ones.
        f"user agents on >{USER_PW} ~* &* +@all -@admin -@dangerous +info +config|get\n"
    )
    # Debian's redis-server is built with TLS; a pip-installed one may not be.
    for binary in dict.fromkeys(filter(None, ["/usr/bin/redis-server", shutil.which("redis-server")])):
        if not Path(binary).exists():
            continue
        port, tls_port = free_port(), free_port()
        proc = subprocess.Popen(
            [
                binary,
                "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(folder), "--logfile", str(folder / "redis.log"),
                "--aclfile", str(acl),
                "--tls-port", str(tls_port),
                "--tls-cert-file", str(certs["cert"]), "--tls-key-file", str(certs["key"]),
                "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        server = SecuredRedis(port, tls_port, certs["ca"])
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline and not _answers(server):
            pass
        if proc.poll() is None and _answers(server):
            try:
                yield server
            finally:
                proc.terminate()
                proc.wait(timeout=10)
            return
        proc.kill()
        proc.wait()
    pytest.skip("no redis-server here starts with TLS")


def _answers(server: SecuredRedis) -> bool:
    try:
        return bool(server.admin().ping())
    except redis.ConnectionError:
        time.sleep(0.05)
        return False


def _everything_stored(client: redis.Redis) -> str:
    """Every key and value in Redis, as text."""
    read = {
        "string": client.get,
        "hash": client.hgetall,
        "list": lambda k: client.lrange(k, 0, -1),
        "set": client.smembers,
        "zset": lambda k: client.zrange(k, 0, -1, withscores=True),
        "stream": client.xrange,
    }
    out = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        out.append(f"{key} {read[kind](key) if kind in read else None}")
    return "\n".join(out)


def test_the_wrong_password_is_refused_clearly(secured: SecuredRedis, tmp_path: Path) -> None:
    bad = f"redis://agents:wrong-{uuid.uuid4().hex[:6]}@127.0.0.1:{secured.port}/0"
    run = agents("session", "list", "--json", env=cli_env(bad, "sec", tmp_path / "home"))
    assert run.returncode == 1 and run.doc["error"]["code"] == "redis_unavailable", run
    assert "wrong-" not in run.stdout + run.stderr, "the password is not echoed"


def test_a_password_url_runs_a_session_inline(secured: SecuredRedis, tmp_path: Path) -> None:
    prefix = f"pw{uuid.uuid4().hex[:8]}"
    env = cli_env(secured.password_url(), prefix, tmp_path / "home")
    run = agents(
        "run", "--agent-file", DEMO_AGENT, "-p", "What is the weather in Paris?", "--inline", "--json", env=env
    )
    assert run.returncode == 0, run
    assert run.doc["state"] == "completed" and "Paris" in run.doc["response"], run
    doctor = agents("doctor", "--json", env=env)
    for text in (run.stdout + run.stderr, doctor.stdout + doctor.stderr):
        assert not any(s in text for s in SECRETS)


def test_tls_with_an_acl_user_through_a_worker(secured: SecuredRedis, tmp_path: Path) -> None:
    prefix = f"tls{uuid.uuid4().hex[:8]}"
    url = secured.tls_acl_url()
    log = tmp_path / "worker.log"
    worker = Worker(worker_env(url, prefix, tmp_path / "home"), log=log, name=f"tls-{prefix}@test").start()
    try:
        tls_client = redis.Redis.from_url(url, decode_responses=True)
        worker.wait_ready(tls_client, prefix)
        env = cli_env(url, prefix, tmp_path / "home")
        started = agents(
            "session", "start", "--agent-file", DEMO_AGENT, "-p",
            "What is the weather in Paris? Please book a table in Paris.", "--run", "--json", env=env,
        )  # fmt: skip
        assert started.returncode == 0, started
        view = started.doc
        assert view["state"] == "waiting", "the booking waits on a person"
        [pending] = view["pending"]
        # Completed through Redis alone, over TLS, as the ACL user.
        tls_client.xadd(f"{prefix}:completions", {"token": pending["token"], "result": json.dumps("booked")})
        done = poll(
            lambda: (
                (v := agents("session", "show", view["session_id"], "--json", env=env).doc)["state"] == "completed"
                and v
            ),
            "the session to complete after the completion",
        )
        assert "booked" in done["response"]
        doctor = agents("doctor", "--json", env=env)
        outputs = started.stdout + started.stderr + doctor.stdout + doctor.stderr
    finally:
        worker.stop()
    outputs += log.read_text(errors="replace")
    assert not any(s in outputs for s in SECRETS), "no password in any output or log"
    stored = _everything_stored(secured.admin())
    assert prefix in stored, "the session's keys are there to look through"
    assert not any(s in stored for s in SECRETS), "no password stored in Redis"
