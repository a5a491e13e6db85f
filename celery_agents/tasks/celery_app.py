"""The worker's Celery app (`celery -A celery_agents.tasks worker`), configured from the environment
when Celery first reads its configuration (`worker_settings`), not when this module is imported."""

from __future__ import annotations

from functools import cache
from typing import Any

from celery import Celery

from celery_agents.config import Settings
from celery_agents.runtime.faults import shift_clock
from celery_agents.tasks import broker
from celery_agents.tasks.config import celery_config


@cache
def worker_settings() -> Settings:
    """This worker's settings, read from its environment once."""
    settings = Settings.from_env()
    shift_clock(settings.fault_clock_shift)  # chaos tests only: 0 unless AGENTS_FAULT_CLOCK_SHIFT is set
    return settings


def _configuration() -> dict[str, Any]:
    return celery_config(worker_settings())


# Only workers consume: the CLI publishes through `tasks.config` and never imports this module.
broker.install()
app = Celery("celery_agents", set_as_current=False)
app.add_defaults(_configuration)  # a promise: read when the configuration is first needed

# Registering the tasks and signal handlers needs `app` defined above.
from celery_agents.tasks import calls, mcp_servers, services, step  # noqa: E402,F401
