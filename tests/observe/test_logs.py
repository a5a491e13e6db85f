"""AGENTS_LOG_FORMAT=json: one JSON object per line, naming the session, step version and call."""

from __future__ import annotations

import io
import json
import logging

import pytest

from celery_agents.config import Settings
from celery_agents.observe import add_context, log_context
from celery_agents.observe.logs import configure


@pytest.fixture
def lines() -> io.StringIO:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    configure([handler], json_lines=True)
    logger = logging.getLogger("tests.observe.json")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    return out


def records(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_each_line_is_one_json_object_naming_what_it_is_about(lines: io.StringIO) -> None:
    log = logging.getLogger("tests.observe.json")
    log.info("outside")
    with log_context(session_id="s1", version=3):
        log.info("in the step")
        add_context(call_id="call_1")
        log.warning("a tool said:\n%s", "two lines")
    outside, step, tool = records(lines)
    assert "session_id" not in outside
    assert step["session_id"] == "s1" and step["version"] == 3 and step["message"] == "in the step"
    assert tool["call_id"] == "call_1" and tool["level"] == "warning" and tool["message"] == "a tool said:\ntwo lines"


def test_an_exception_stays_inside_its_line(lines: io.StringIO) -> None:
    log = logging.getLogger("tests.observe.json")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    (rec,) = records(lines)
    assert "ValueError: boom" in str(rec["exception"])


def test_an_unknown_log_format_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTS_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="AGENTS_LOG_FORMAT='xml'"):
        Settings.from_env()


def test_tracing_is_on_with_an_otlp_endpoint_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTS_TRACING", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert not Settings.from_env().tracing_on
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert Settings.from_env().tracing_on
    monkeypatch.setenv("AGENTS_TRACING", "off")
    assert not Settings.from_env().tracing_on
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("AGENTS_TRACING", "1")
    assert Settings.from_env().tracing_on
