"""Agent files for the scripted model server, with command tools that count their runs.

`probe_sync` (runSync) and `probe_async` (runAsync) are one command tool that appends a line
`<tool> <arguments>` to a counter file at each run and answers `{"tool": ..., "args": ...}`;
`approve` is external and deferred (a person completes it). `probe_iso` runs isolated (a shell
one-liner answering the same shape, since the sandbox sees no test folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

_TOOL = """\
import json, sys
args = json.load(sys.stdin)
with open(sys.argv[1], "a") as f:
    f.write(sys.argv[2] + " " + json.dumps(args, sort_keys=True) + "\\n")
print(json.dumps({"tool": sys.argv[2], "args": args}))
"""

# The sandbox sees no test folder: the isolated tool needs nothing but a shell.
_ISOLATED = 'read -r args; echo "{\\"tool\\": \\"probe_iso\\", \\"args\\": $args}"'

_PARAMS = {"type": "object", "properties": {"x": {"type": "string"}}}


def write_probe_agent(
    folder: Path,
    scenario: str,
    api_base: str,
    *,
    defer_timeout: float | None = None,
    name: str = "agent.json",
    **extra: Any,
) -> tuple[Path, Path]:
    """Write the probe tool and an agent file for `openai/<scenario>`; returns (agent file, counter)."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "probe_tool.py"
    tool.write_text(_TOOL)
    counter = folder / f"{Path(name).stem}.runs"
    counter.touch()

    def command(tool_name: str) -> list[str]:
        return [sys.executable, str(tool), str(counter), tool_name]

    defer: dict[str, Any] = {"tag": "defer", "reason": "a person approves"}
    if defer_timeout is not None:
        defer["timeoutSeconds"] = defer_timeout
    agent = {
        "slug": "probe",
        "model": f"openai/{scenario}",
        "apiBase": api_base,
        "systemPrompt": "You are a test agent.",
        "maxSteps": 20,
        "tools": [
            {
                "name": "probe_sync",
                "description": "runs inline",
                "parameters": _PARAMS,
                "command": command("probe_sync"),
            },
            {
                "name": "probe_async",
                "description": "runs as its own task",
                "parameters": _PARAMS,
                "command": command("probe_async"),
            },
            {
                "name": "probe_iso",
                "description": "runs isolated",
                "parameters": _PARAMS,
                "command": ["/bin/sh", "-c", _ISOLATED],
            },
            {"name": "approve", "description": "a person approves", "parameters": _PARAMS, "external": True},
        ],
        "executionMode": "asynchronous",
        "toolCallPolicy": {
            "default": "runSync",
            "rules": [
                {"tool": "probe_async", "disposition": {"tag": "runAsync"}},
                {"tool": "probe_iso", "disposition": {"tag": "runIsolated"}},
                {"tool": "approve", "disposition": defer},
            ],
        },
    }
    agent.update(extra)
    path = folder / name
    path.write_text(json.dumps(agent, indent=2))
    return path, counter


def runs(counter: Path) -> list[str]:
    """The tool runs recorded so far, one `<tool> <arguments>` line each."""
    return counter.read_text().splitlines()


def tool_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool results at the end of a chat-completions request, in order."""
    tail = []
    for m in reversed(request["messages"]):
        if m.get("role") != "tool":
            break
        tail.append(m)
    return list(reversed(tail))
