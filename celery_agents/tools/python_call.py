"""Calling a python tool: in the worker (runSync, runAsync) or in a child interpreter (runIsolated).

Either way the answer is an envelope: `{"ok": true, "value": ...}` or `{"ok": false, "kind":
"load" | "arguments" | "exception", "error": ..., "retryable": ...}`. An exception marks itself
retryable with a `retryable = True` attribute. In the worker the call runs in a thread so the
timeout can be reported; such a thread cannot be killed and runs on until the worker's pool
process that holds it is replaced after its task (runIsolated kills).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from celery_agents.tools.output import cut
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


_overrun: list[threading.Thread] = []
_overrun_lock = threading.Lock()


def call_in_thread(spec: str, arguments: Any, timeout: float, folder: str | None = None) -> dict[str, Any] | None:
    """The envelope, or None when the call did not finish within `timeout` seconds (the thread
    then runs on: see `overrunning_calls`)."""
    box: list[dict[str, Any]] = []
    thread = threading.Thread(
        target=lambda: box.append(call_function(spec, arguments, folder)), name=f"tool:{spec}", daemon=True
    )
    thread.start()
    thread.join(timeout)
    if box:
        return box[0]
    with _overrun_lock:
        _overrun.append(thread)
    return None


def overrunning_calls() -> list[str]:
    """The python tool calls of this process still running past their timeout (a thread cannot be
    killed; a worker's pool process leaves after its task so that the pool starts a fresh one)."""
    with _overrun_lock:
        _overrun[:] = [t for t in _overrun if t.is_alive()]
        return [t.name.removeprefix("tool:") for t in _overrun]


def child_request(spec: str, arguments: Any, path: list[str], output_cap: int) -> bytes:
    return json.dumps({"function": spec, "arguments": arguments, "path": path, "output_cap": output_cap}).encode()


def child_main(request: dict[str, Any]) -> None:
    """In the child interpreter: the envelope on the real stdout; the tool's prints go to stderr."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    envelope = call_function(request["function"], request.get("arguments"))
    text = json.dumps(envelope, ensure_ascii=False)
    cap = int(request.get("output_cap") or 0)
    if cap and len(text.encode()) > cap and envelope.get("ok"):
        value, size = cut(envelope["value"], max(cap - 1024, 256))
        text = json.dumps(
            {"ok": True, "value": value, "output_capped": {"written": size, "cap": cap}}, ensure_ascii=False
        )
    out.write(text)
    out.flush()
