"""Python tool functions the tests declare as `"python": "tests.tools.sample_tools:<name>"`."""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path
from typing import Any, Literal

PNG_1PX = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()


class FlakyError(Exception):
    retryable = True


def forecast(city: str, days: int = 3, unit: Literal["C", "F"] = "C") -> dict[str, Any]:
    """The forecast for a city.

    Made up, for tests."""
    return {"city": city, "days": days, "unit": unit}


def add(a: int, b: int) -> int:
    return a + b


def explode(reason: str) -> None:
    raise ValueError(f"cannot do that: {reason}")


def flaky(key: str, failures: int) -> str:
    """Fails `failures` times for `key` (a file counting its attempts: each call is a process of its
    own) with a retryable error, then answers."""
    counter = Path(key)
    n = int(counter.read_text() if counter.exists() else "0") + 1
    counter.write_text(str(n))
    if n <= failures:
        raise FlakyError(f"temporary failure {n}")
    return f"ok after {n}"


def hang(pidfile: str = "") -> str:
    """Sleeps past any timeout a test gives it; says which process it runs in."""
    import time

    if pidfile:
        Path(pidfile).write_text(str(os.getpid()))
    time.sleep(30)
    return "released"


def picture(caption: str = "") -> dict[str, Any]:
    return {"type": "image", "mimeType": "image/png", "base64Data": PNG_1PX, "filename": f"{caption or 'dot'}.png"}


def mixed() -> list[dict[str, Any]]:
    return [{"type": "text", "text": "here is the chart"}, {"type": "image", "mimeType": "image/png", "data": PNG_1PX}]


def whoami() -> dict[str, Any]:
    return {"pid": os.getpid(), "env": sorted(os.environ), "cwd": os.getcwd(), "home": os.environ.get("HOME")}


def switch_interval() -> float:
    """The interpreter's GIL switch interval in the process that runs this tool (a runSync python
    tool runs in the steps process, on the step's thread)."""
    return sys.getswitchinterval()


def big(size: int) -> str:
    return "z" * size


def allocate(megabytes: int) -> int:
    block = bytearray(megabytes * 1024 * 1024)
    return len(block)


def write_file(path: str) -> str:
    Path(path).write_text("written by a tool")
    return "wrote it"


def spin(pidfile: str) -> str:
    """Never returns (a tool that ignores its timeout); says which process it runs in."""
    import time

    Path(pidfile).write_text(str(os.getpid()))
    while True:
        time.sleep(0.01)
