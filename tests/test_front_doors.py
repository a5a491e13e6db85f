"""The front doors (the CLI, the HTTP API and page, the MCP server) reach Redis only through the
`Client`: none of them reaches a client's `.store` (their imports are ruled in tests/test_layers.py:
no `celery_agents.store`, no redis-py)."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_agents

PACKAGE = Path(celery_agents.__file__).parent
FRONT_DOORS = [
    *sorted((PACKAGE / "cli").glob("*.py")),
    *sorted((PACKAGE / "web").glob("*.py")),
    PACKAGE / "mcp_server.py",
]


def test_front_doors_reach_the_store_only_through_the_client() -> None:
    offenders: dict[str, list[int]] = {}
    for path in FRONT_DOORS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "store"]
        if lines:
            offenders[str(path.relative_to(PACKAGE))] = lines
    assert offenders == {}
