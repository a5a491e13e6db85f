"""`session show` without --json names a session's parent and children."""

from __future__ import annotations

import io

from rich.console import Console

from celery_agents.cli.output import render_view
from celery_agents.model import SessionView, State


def test_show_names_the_parent_and_the_children() -> None:
    view = SessionView(
        session_id="a" * 32, state=State.WAITING, head="PartialUserTurn", version=3, steps=2,
        parent="b" * 32, children=["c" * 32, "d" * 32],
    )  # fmt: skip
    out = io.StringIO()
    render_view(view, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert f"parent {'b' * 32}" in text and f"children {'c' * 32} {'d' * 32}" in text


def test_show_of_a_top_session_without_children_says_nothing_of_them() -> None:
    view = SessionView(session_id="a" * 32, state=State.READY, head="UserTurn", version=1, steps=0)
    out = io.StringIO()
    render_view(view, Console(file=out, width=200, color_system=None))
    assert "parent" not in out.getvalue() and "children" not in out.getvalue()
