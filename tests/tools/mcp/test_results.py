"""An MCP `CallToolResult` as the outcome the model sees."""

from __future__ import annotations

from celery_agents.tools.mcp.results import outcome_of_result
from tests.tools.mcp.sample_server import PNG

IMAGE = {"type": "image", "mimeType": "image/png", "data": __import__("base64").b64encode(PNG).decode()}


def test_text_parts_are_joined_into_the_result() -> None:
    out = outcome_of_result({"content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}, 1000)
    assert (out.state, out.result, out.media) == ("completed", "one\ntwo", [])


def test_the_structured_result_wins_over_its_text_rendering() -> None:
    raw = {"content": [{"type": "text", "text": '{"t": 1}'}], "structuredContent": {"t": 1}}
    assert outcome_of_result(raw, 1000).result == {"t": 1}


def test_images_become_media_beside_the_text() -> None:
    out = outcome_of_result({"content": [{"type": "text", "text": "a chart"}, IMAGE]}, 1000)
    assert out.result == "a chart" and [m.mime_type for m in out.media] == ["image/png"]


def test_an_embedded_text_resource_counts_as_text() -> None:
    part = {"type": "resource", "resource": {"uri": "file:///x.txt", "text": "file body"}}
    assert outcome_of_result({"content": [part]}, 1000).result == "file body"


def test_is_error_is_a_failed_call_with_its_text_or_a_default() -> None:
    failed = outcome_of_result({"content": [{"type": "text", "text": "no such city"}], "isError": True}, 1000)
    assert (failed.state, failed.error) == ("failed", "no such city")
    bare = outcome_of_result({"content": [], "isError": True}, 1000)
    assert (bare.state, bare.error) == ("failed", "the MCP tool reported an error")


def test_a_result_over_the_cap_is_cut_and_says_so() -> None:
    out = outcome_of_result({"content": [{"type": "text", "text": "x" * 5000}]}, 100)
    assert out.meta.output_capped == {"written": 5000, "cap": 100} and "[truncated" in out.result
