"""What the model chooses cannot wedge a session or grow it without bound, on real workers: more
tool calls than `maxToolCallsPerTurn` (thousands of them), NUL bytes in call ids and arguments,
tool results far over AGENTS_MAX_RESULT_BYTES, and completions over it on the stream. Each
becomes an error result (or a cut one) the model sees, and the session goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import ONE_MIB, Settings
from tests.e2e.conftest import record_tool, runs, wait_for
from tests.support.llm_server import LlmServer, calls, text

pytestmark = pytest.mark.slow


def tool_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in request["messages"] if m["role"] == "tool"]


def agent(model: str, api_base: str, tools: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"slug": "hostile", "model": f"openai/{model}", "apiBase": api_base, "tools": tools, **extra}


def run_to_end(settings: Settings, path: Path, prompt: str = "go") -> Any:
    with Client(settings) as client:
        view = client.start(path, prompt, run=True, timeout=120)
        assert view.state.value == "completed", view
        return client.show(view.session_id)


def test_thousands_of_tool_calls_run_at_most_max_tool_calls_per_turn(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    many = [("count", {"x": i}) for i in range(8200)]
    scenario = llm_server.scenario([calls(*many), text("counted")])
    path = write_agent(agent(scenario, llm_server.url, [record_tool("count", log)], maxToolCallsPerTurn=3))
    view = run_to_end(module_settings, path)
    assert view.response == "counted"
    answers = tool_messages(llm_server.requests[scenario][-1])
    assert len(answers) == 8200, "the model hears back about every call, in its order"
    assert [json.loads(a["content"])["echo"]["x"] for a in answers[:3]] == [0, 1, 2]
    assert all("maxToolCallsPerTurn" in a["content"] and "not run" in a["content"] for a in answers[3:])
    assert len(runs(log, "count")) == 3, "calls beyond the limit never run"


def test_the_default_limit_is_64_calls(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    tool = {"name": "add", "python": "tests.tools.sample_tools:add"}
    scenario = llm_server.scenario([calls(*[("add", {"a": i, "b": 1}) for i in range(70)]), text("added")])
    run_to_end(module_settings, write_agent(agent(scenario, llm_server.url, [tool])))
    answers = tool_messages(llm_server.requests[scenario][-1])
    assert [a["content"] for a in answers[:64]] == [str(i + 1) for i in range(64)]
    assert all("maxToolCallsPerTurn" in a["content"] for a in answers[64:]) and len(answers) == 70


SCRIPT = """#!/usr/bin/env python3
print("got " + repr(sys.argv[1:]))
"""


@pytest.mark.parametrize("disposition", ["runSync", "runAsync"])
def test_nul_bytes_in_call_ids_and_arguments_become_results_the_model_sees(
    disposition: str,
    workers: Any,
    module_settings: Settings,
    llm_server: LlmServer,
    write_agent: Any,
    tmp_path: Path,
) -> None:
    log = tmp_path / "runs.jsonl"
    script = tmp_path / "echo-args.py"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    tools = [
        record_tool("rec", log),
        {
            "name": "say",
            "script": str(script),
            "scriptArgs": [{"name": "word", "mode": "positional"}],
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    ]
    policy = {"default": disposition}
    scenario = llm_server.scenario(
        [
            calls(("rec", {"x": 1}, "call\x00id"), ("say", {"word": "a\x00b"}, "call_ok"), ("say", {"word": "fine"})),
            text("carried on"),
        ]
    )
    path = write_agent(agent(scenario, llm_server.url, tools, toolCallPolicy=policy))
    view = run_to_end(module_settings, path)
    assert view.response == "carried on"
    answers = tool_messages(llm_server.requests[scenario][-1])
    assert len(answers) == 3 and "\x00" not in json.dumps([a["tool_call_id"] for a in answers])
    assert json.loads(answers[0]["content"])["echo"] == {"x": 1}, "a bad call id does not stop the call"
    assert "NUL" in answers[1]["content"], "the bad argument is an error the model sees"
    assert "fine" in answers[2]["content"]


def test_a_huge_tool_result_is_cut_to_the_limit_before_it_is_stored(
    workers: Any, module_settings: Settings, llm_server: LlmServer, write_agent: Any, rclient: Any
) -> None:
    size = 8 * ONE_MIB
    tools = [
        {"name": "big", "python": "tests.tools.sample_tools:big", "limits": {"outputBytes": 100 * ONE_MIB}},
        {"name": "big_async", "python": "tests.tools.sample_tools:big", "limits": {"outputBytes": 100 * ONE_MIB}},
    ]
    policy = {"default": "runSync", "rules": [{"tool": "big_async", "disposition": "runAsync"}]}
    scenario = llm_server.scenario(
        [calls(("big", {"size": size}), ("big_async", {"size": size})), text("read it"), text("again")]
    )
    path = write_agent(agent(scenario, llm_server.url, tools, toolCallPolicy=policy))
    view = run_to_end(module_settings, path)
    answers = tool_messages(llm_server.requests[scenario][-1])
    for answer in answers:
        assert len(answer["content"].encode()) <= ONE_MIB + 1000, "the model gets at most the limit"
        assert "AGENTS_MAX_RESULT_BYTES" in answer["content"], "and is told the result was cut"
    prefix = module_settings.prefix
    stored = sum(rclient.memory_usage(k) or 0 for k in rclient.scan_iter(match=f"{prefix}:s:{{{view.session_id}}}:*"))
    # Each result is kept twice (the call's ledger and the tool responses turn): 2 x 2 x the limit.
    assert stored < 5 * ONE_MIB, f"the session holds {stored} bytes: the results were stored whole"


def test_a_stream_completion_over_the_limit_is_rejected_and_the_call_still_waits(
    workers: Any, module_settings: Settings, rclient: Any
) -> None:
    from tests.cli.process import DEMO_AGENT

    with Client(module_settings) as client:
        view = client.start(DEMO_AGENT, "Please book a table in Paris.", run=True, timeout=60)
        [pending] = view.pending
        key = f"{module_settings.prefix}:completions"
        rclient.xadd(key, {"token": pending.token, "result": json.dumps("x" * (ONE_MIB + 10)), "by": "big"})
        rejected = wait_for(
            lambda: [e for e in rclient.xrange(f"{key}:rejected") if e[1].get("by") == "big"], what="a rejection"
        )
        assert rejected[0][1]["reason"] == "invalid_result"
        assert "AGENTS_MAX_RESULT_BYTES" in rejected[0][1]["message"]
        assert [p.token for p in client.pending(view.session_id)] == [pending.token], "nothing was applied"
        rclient.xadd(key, {"token": pending.token, "result": json.dumps("booked")})
        wait_for(lambda: client.view(view.session_id).state.value == "completed", what="the session to complete")
