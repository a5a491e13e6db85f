"""MCP test servers: the SDK-written `sample_server.py` over stdio or Streamable HTTP (started by
the test), the third-party `mcp-server-time`, and agents built around them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_agents.model import AgentSpec, TrackedCall
from celery_agents.tools.resolve import parse_agent
from tests.support.ports import free_port

SAMPLE = Path(__file__).with_name("sample_server.py")
TIME_SERVER = [sys.executable, "-m", "mcp_server_time"]


def sample_stdio(name: str = "sample", **extra: Any) -> dict[str, Any]:
    return {"name": name, "command": [sys.executable, str(SAMPLE)], **extra}


def mcp_agent(servers: list[dict[str, Any]], rules: list[dict[str, Any]] | None = None, **extra: Any) -> AgentSpec:
    data: dict[str, Any] = {"slug": "mcp-test", "model": "openai/none", "mcpServers": servers, **extra}
    if rules is not None:
        data["toolCallPolicy"] = {"default": "runSync", "rules": rules}
    return parse_agent(data, "mcp-agent.json")


def mcp_call(tool: str, arguments: dict[str, Any], call_id: str = "call_1") -> TrackedCall:
    return TrackedCall(
        call_id=call_id,
        tool=tool,
        arguments=arguments,
        raw_arguments=json.dumps(arguments),
        batch=1,
        position=0,
        disposition="runSync",
    )


@pytest.fixture(scope="session")
def http_server() -> Iterator[str]:
    """The sample server over Streamable HTTP, started here; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SAMPLE), "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the Streamable HTTP sample server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
