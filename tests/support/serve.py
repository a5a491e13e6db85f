"""A real `agents serve` process (uvicorn) for tests, on a free loopback port."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.ports import free_port

CLI_SERVE = [sys.executable, "-m", "celery_agents.cli", "serve"]


class Serve:
    """`agents serve` in a subprocess; `wait_ready` waits until it answers."""

    def __init__(self, env: dict[str, str], log: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.env = env
        self.log = log
        self.port = port or free_port()
        self.host = host
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Serve:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*CLI_SERVE, "--host", self.host, "--port", str(self.port), "-l", "warning"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    def wait_ready(self, timeout: float = 90) -> Serve:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"agents serve exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                # Any answer (401 included) means uvicorn is up.
                httpx.get(f"{self.url}/static/page.css", timeout=2)
                return self
            time.sleep(0.1)
        raise RuntimeError(f"agents serve did not answer within {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> Serve:
        return self.start().wait_ready()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
