"""Worker logs: what session, step version and call a line is about, and `AGENTS_LOG_FORMAT=json`.

The step and call tasks name what they work on in context variables (one set per thread, so a
threads-pool worker's concurrent steps never mix them up); a filter copies them onto every record,
and the JSON formatter writes one object per line. The standard library only: no cost when unused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar, Token
from typing import Any

#: what the current thread works on: session_id, version, call_id (those known)
_context: ContextVar[dict[str, Any] | None] = ContextVar("agents_log_context", default=None)

#: loggers that repeat themselves once per process or per call (litellm's notices, HTTP lines)
NOISY = {
    "LiteLLM": logging.ERROR,
    "LiteLLM Router": logging.ERROR,
    "LiteLLM Proxy": logging.ERROR,
    "litellm": logging.ERROR,
    "httpx": logging.WARNING,
    "httpcore": logging.WARNING,
}


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Name what the lines logged inside are about (fields given as None are left out)."""
    current = _context.get() or {}
    token = _context.set({**current, **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def add_context(**fields: Any) -> None:
    """Add to what the current lines are about, until the enclosing `log_context` ends."""
    current = _context.get()
    if current is not None:
        current.update({k: v for k, v in fields.items() if v is not None})


class ContextFilter(logging.Filter):
    """Copies the current session id, step version and call id onto each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


#: record attributes that are not extra fields
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, process, message, context, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, int | float | bool | str) or value is None else str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def quiet_noisy_loggers() -> None:
    for name, level in NOISY.items():
        logging.getLogger(name).setLevel(level)


def configure(handlers: list[logging.Handler], json_lines: bool) -> None:
    """Context on every record of these handlers, and JSON lines when asked."""
    for handler in handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())
        if json_lines:
            handler.setFormatter(JsonFormatter())
    quiet_noisy_loggers()


def configure_root(json_lines: bool, level: str = "INFO") -> None:
    """For a process whose logging nobody set up yet (the supervisor)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level.upper(), format="[%(asctime)s: %(levelname)s/supervisor] %(message)s")
    configure(list(root.handlers), json_lines)


TaskFields = Callable[[str, Sequence[Any]], dict[str, Any]]


def connect_celery(json_lines: Callable[[], bool], task_fields: TaskFields) -> None:
    """Celery sets up a worker's loggers itself: apply ours once it has. Each task's lines, Celery's
    own included ("succeeded in..."), name what `task_fields(task name, args)` says it is about."""
    from celery.signals import after_setup_logger, after_setup_task_logger, task_postrun, task_prerun

    def apply(logger: logging.Logger | None = None, **_: Any) -> None:
        targets = list(logger.handlers) if logger is not None else []
        configure(targets + list(logging.getLogger().handlers), json_lines())

    resets: dict[str, Token[dict[str, Any] | None]] = {}

    def enter(task_id: str = "", task: Any = None, args: Sequence[Any] = (), **_: Any) -> None:
        fields = task_fields(getattr(task, "name", ""), args or ())
        if fields:
            resets[task_id] = _context.set(fields)

    def leave(task_id: str = "", **_: Any) -> None:
        token = resets.pop(task_id, None)
        if token is not None:
            with contextlib.suppress(ValueError):  # set in another context: nothing of ours to undo
                _context.reset(token)

    after_setup_logger.connect(apply, weak=False)
    after_setup_task_logger.connect(apply, weak=False)
    task_prerun.connect(enter, weak=False)
    task_postrun.connect(leave, weak=False)
