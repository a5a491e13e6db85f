"""Completing from the page, the API, the CLI and the completions stream (XADD) is one operation:
when all four race for one token, exactly one wins and the other three are told it was taken; so
is approving a gate, whose tool then runs once. The CLI contender starts first (a process takes a
while to start) and waits on its stdin, written when the others pass the barrier."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.conftest import runs, wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.serve import Serve
from tests.support.workers import worker_env
from tests.web.conftest import blocked, gated_agent, one_approval, read_events

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("web_workers")]
CLI = [sys.executable, "-m", "celery_agents.cli"]


def page_form(server: Serve, api_token: str) -> tuple[httpx.Client, str]:
    """A browser-like client signed in to the page, and the CSRF field of its forms."""
    page = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {api_token}"}, timeout=60)
    found = re.search(r'name="csrf" value="([^"]+)"', page.get("/").text)
    assert found
    return page, found.group(1)


def race_once(
    api: httpx.Client, server: Serve, api_token: str, llm_server: LlmServer, redis_url: str, prefix: str
) -> None:
    view = blocked(api, one_approval(llm_server, answer="settled"))
    sid, token = view["session_id"], view["pending"][0]["token"]
    page, csrf = page_form(server, api_token)
    cli = subprocess.Popen(
        [sys.executable, "-m", "celery_agents.cli", "session", "complete", token, "-", "--json"],
        env=worker_env(redis_url, prefix),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    go = threading.Barrier(4)
    said: dict[str, Any] = {}

    def by_api() -> None:
        go.wait(timeout=60)
        said["api"] = api.post(f"/v1/continuations/{token}", json={"result": {"by": "api"}}).status_code

    def by_page() -> None:
        go.wait(timeout=60)
        form = {"csrf": csrf, "token": token, "result": '{"by": "page"}', "back": "/"}
        said["page"] = page.post("/approve", data=form).headers["location"]

    def by_stream() -> None:
        go.wait(timeout=60)
        r.xadd(f"{prefix}:completions", {"token": token, "result": json.dumps({"by": "xadd"})})

    threads = [threading.Thread(target=f) for f in (by_api, by_page, by_stream)]
    for t in threads:
        t.start()
    go.wait(timeout=60)
    out, err = cli.communicate(json.dumps({"by": "cli"}).encode(), timeout=120)
    for t in threads:
        t.join(timeout=120)

    read_events(api, sid, until="completed")
    shown = api.get(f"/v1/sessions/{sid}", params={"detail": "true"}).json()
    (result,) = [r["content"] for t in shown["turns"] for r in t.get("tool_responses", [])]
    winner = result["by"]
    cli_won = cli.returncode == 0
    assert cli.returncode in (0, 5), err.decode()[-500:]
    reported = {
        "api": said["api"] == 200,
        "page": said["page"] == "/?done=approved",
        "cli": cli_won,
    }
    assert said["api"] in (200, 409) and said["page"] in ("/?done=approved", "/?problem=token_already_completed")
    if not cli_won:
        assert json.loads(out)["error"]["code"] == "token_already_completed"
    assert [who for who, won in reported.items() if won] == ([] if winner == "xadd" else [winner])

    def stream_lost() -> bool:
        return any(f.get("token") == token for _, f in r.xrange(f"{prefix}:completions:rejected"))

    if winner != "xadd":
        wait_for(stream_lost, timeout=60, what="the worker to record the stream's completion as rejected")
    else:
        assert not stream_lost()
    page.close()
    r.close()


def test_page_api_cli_and_stream_race_for_one_token_and_exactly_one_wins(
    api: httpx.Client, server: Serve, api_token: str, llm_server: LlmServer, redis_url: str, module_prefix: str
) -> None:
    for _ in range(2):
        race_once(api, server, api_token, llm_server, redis_url, module_prefix)


def approval_race_once(
    api: httpx.Client, server: Serve, api_token: str, llm_server: LlmServer, redis_url: str, prefix: str, log: Path
) -> None:
    view = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 500})), text("paid")]))
    sid, (gate,) = view["session_id"], view["pending"]
    token, digest = gate["token"], gate["digest"]
    page, csrf = page_form(server, api_token)
    # The CLI approves with the model's own arguments read from stdin (an approval, not an edit):
    # started now, it waits on stdin, which is written once the others pass the barrier.
    cli = subprocess.Popen(
        [*CLI, "session", "approve", token, "--arguments", "-", "--digest", digest, "--by", "cli", "--json"],
        env=worker_env(redis_url, prefix),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    go = threading.Barrier(3)
    said: dict[str, Any] = {}

    def by_api() -> None:
        go.wait(timeout=60)
        said["api"] = api.post(
            f"/v1/continuations/{token}", json={"decision": "approve", "digest": digest, "by": "api"}
        )

    def by_page() -> None:
        go.wait(timeout=60)
        form = {"csrf": csrf, "token": token, "digest": digest, "back": "/"}
        said["page"] = page.post("/gates/approve", data=form).headers["location"]

    threads = [threading.Thread(target=f) for f in (by_api, by_page)]
    for t in threads:
        t.start()
    go.wait(timeout=60)
    r.xadd(f"{prefix}:completions", {"token": token, "decision": "approve", "digest": digest, "by": "xadd"})
    out, err = cli.communicate(json.dumps(gate["arguments"]).encode(), timeout=120)
    for t in threads:
        t.join(timeout=120)

    (approved,) = [e for e in read_events(api, sid, until="completed") if e["type"] == "call_approved"]
    winner = approved["by"]
    assert cli.returncode in (0, 5), err.decode()[-500:]
    if cli.returncode == 5:
        assert json.loads(out)["error"]["code"] == "token_already_completed"
    else:
        assert json.loads(out)["decision"] == "approved", "the model's arguments: an approval, not an edit"
    if said["api"].status_code != 200:
        assert said["api"].json()["error"]["code"] == "token_already_completed"
    assert said["page"] in ("/?done=run", "/?problem=token_already_completed")
    reported = {"api": said["api"].status_code == 200, "page": said["page"] == "/?done=run", "cli": cli.returncode == 0}
    assert [who for who, won in reported.items() if won] == ([] if winner == "xadd" else [winner])

    def stream_lost() -> bool:
        return any(f.get("token") == token for _, f in r.xrange(f"{prefix}:completions:rejected"))

    if winner != "xadd":
        wait_for(stream_lost, timeout=60, what="the worker to record the stream's approval as rejected")
    assert [run["args"] for run in runs(log, "pay", "start")] == [{"amount": 500}], "the tool ran once"
    page.close()
    r.close()


def test_approvals_from_the_page_api_cli_and_stream_race_for_one_gate_and_the_tool_runs_once(
    api: httpx.Client,
    server: Serve,
    api_token: str,
    llm_server: LlmServer,
    redis_url: str,
    module_prefix: str,
    tmp_path: Path,
) -> None:
    for i in range(2):
        approval_race_once(api, server, api_token, llm_server, redis_url, module_prefix, tmp_path / f"runs{i}.log")
