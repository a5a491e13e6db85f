"""Label values stay a bounded set: a tool name the model made up is never a label of its own."""

from __future__ import annotations

from pathlib import Path

from celery_agents import observe
from celery_agents.model import AgentSpec


def agent() -> AgentSpec:
    return AgentSpec.model_validate(
        {"slug": "a", "model": "openai/x", "tools": [{"name": "lookup", "description": "d", "external": True}]}
    )


def test_a_tool_of_the_agent_file_is_its_own_label() -> None:
    assert observe.tool_label(agent(), "lookup") == "lookup"


def test_any_other_name_the_model_writes_counts_as_other() -> None:
    for made_up in ("Lookup", "lookup\n", "x" * 10_000, "", "drop table"):
        assert observe.tool_label(agent(), made_up) == "_other"
    assert observe.tool_label(None, "lookup") == "_other"


def test_no_worker_name_puts_its_metrics_folder_outside_the_metrics_root(tmp_path: Path) -> None:
    from celery_agents.observe.metrics import worker_folder

    root = tmp_path / "metrics"
    for name in ("..", ".", "a/../../b", "/etc", "w1@host", "x" * 1000):
        folder = worker_folder(root, name)
        assert folder.parent == root and folder.name not in (".", "..") and "/" not in folder.name
