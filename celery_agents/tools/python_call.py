"""Calling a python tool in a child interpreter of its own, for every disposition.

For runSync and runAsync the child is forked by the worker process's fork server of the tool's
module (forkserver.py), which was started with the allow-listed environment and the tool's own
variables and has imported what calling needs, the module and its argument models included; the
child takes the call's environment (tools/command.py `tool_environment`) and working directory
from its request, leads its own process group and is killed at the timeout, as a command tool is.
runIsolated starts `python -I -B -c CHILD_BOOTSTRAP` in the sandbox (so does a worker process
whose fork server cannot start). Either way the request (function, arguments, import path, output
cap) is on the child's stdin, and a python tool never sees the worker's environment, memory or
keys; one that hangs is killed instead of running on in the worker.

The answer is an envelope on the child's stdout: `{"ok": true, "value": ...}` or `{"ok": false,
"kind": "load" | "arguments" | "exception", "error": ..., "retryable": ...}`. An exception marks
itself retryable with a `retryable = True` attribute. What the tool prints goes to its stderr.

A child started afresh imports only what calling needs (this module, tools/signature.py and
pydantic); its start is most of what such a call costs (docs/tools.md gives the figures).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from celery_agents.tools.signature import BadArguments, bind_arguments, load_function

#: what the child interpreter runs (`python -I -B -c CHILD_BOOTSTRAP`, the request on stdin)
CHILD_BOOTSTRAP = (
    "import sys, json; request = json.loads(sys.stdin.buffer.read()); sys.path[:0] = request['path']; "
    "from celery_agents.tools.python_call import child_main; child_main(request)"
)


def jsonable(value: Any) -> Any:
    """The value as JSON can carry it (pydantic models dumped, bytes decoded, else its str)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        pass
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump(mode="json")
        except Exception:
            pass
    return str(value)


def call_function(spec: str, arguments: Any, folder: str | None = None) -> dict[str, Any]:
    """Load (from `folder` too, the agent file's), bind and call; never raises (the envelope
    says what went wrong)."""
    try:
        func = load_function(spec, folder)
    except Exception as exc:
        return {"ok": False, "kind": "load", "error": f"cannot load {spec}: {exc}", "retryable": False}
    try:
        kwargs = bind_arguments(func, arguments if isinstance(arguments, dict) else {})
    except BadArguments as exc:
        return {"ok": False, "kind": "arguments", "error": str(exc), "retryable": False}
    except Exception as exc:  # a signature pydantic cannot model
        return {"ok": False, "kind": "load", "error": f"cannot call {spec}: {exc}", "retryable": False}
    try:
        value = func(**kwargs)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return {"ok": False, "kind": "exception", "error": text, "retryable": bool(getattr(exc, "retryable", False))}
    return {"ok": True, "value": jsonable(value)}


def child_request(
    spec: str,
    arguments: Any,
    path: list[str],
    output_cap: int,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> bytes:
    """The request a child reads on its stdin; `env` and `cwd` are for a child forked by the fork
    server (one started afresh gets them from its parent)."""
    request = {"function": spec, "arguments": arguments, "path": path, "output_cap": output_cap, "env": env, "cwd": cwd}
    return json.dumps(request).encode()


def child_main(request: dict[str, Any]) -> None:
    """In the child interpreter: the envelope on the real stdout; the tool's prints go to stderr."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    envelope = call_function(request["function"], request.get("arguments"))
    text = json.dumps(envelope, ensure_ascii=False)
    cap = int(request.get("output_cap") or 0)
    if cap and len(text.encode()) > cap and envelope.get("ok"):
        from celery_agents.tools.output import cut  # only when it is needed: it imports the models

        value, size = cut(envelope["value"], max(cap - 1024, 256))
        text = json.dumps(
            {"ok": True, "value": value, "output_capped": {"written": size, "cap": cap}}, ensure_ascii=False
        )
    out.write(text)
    out.flush()
