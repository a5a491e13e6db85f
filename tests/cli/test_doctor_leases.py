"""`agents doctor` counts steps whose worker picked them up and stopped renewing the lease."""

from __future__ import annotations

import dataclasses
import time

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.tools.resolve import parse_agent


def test_a_lapsed_step_lease_is_reported(settings: Settings) -> None:
    settings = dataclasses.replace(settings, lease_seconds=0.05, owed_grace=0.0)
    with Client(settings, inline=False) as client:
        store = client.store
        h = store.create_session(
            parse_agent({"slug": "d", "model": "demo/x"}), UserQuery(text="hi"), drive="auto", owe=True
        )
        assert client.doctor()["lapsed_leases"] == 0
        assert store.begin_step(h.session_id, 1, "a-worker-that-dies").outcome == "ok"
        deadline = time.monotonic() + 5
        while store.lease_holder(h.session_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        report = client.doctor()
        assert report["lapsed_leases"] == 1
        assert any(c["name"] == "leases" and not c["ok"] for c in report["checks"])
