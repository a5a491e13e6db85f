"""The worker's Celery app (`celery -A celery_agents.tasks worker`), configured from the environment."""

from __future__ import annotations

from celery_agents.config import Settings
from celery_agents.runtime.faults import shift_clock
from celery_agents.tasks import broker
from celery_agents.tasks.config import make_app

shift_clock()  # chaos tests only: inert unless AGENTS_FAULT_CLOCK_SHIFT is set
# Only workers consume: the CLI publishes through `tasks.config` and never imports this module.
broker.install()
settings = Settings.from_env()
app = make_app(settings)

# Registering the tasks and signal handlers needs `app` defined above.
from celery_agents.tasks import calls, mcp_servers, services, step  # noqa: E402,F401
