"""Celery: the app and its configuration, the `step` task, tool tasks, the sweeper, `agents worker`.

`celery -A celery_agents.tasks worker` finds the app here; importing this package alone does not
build it (the CLI imports only `tasks.config` to publish).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        from celery_agents.tasks.celery_app import app

        return app
    raise AttributeError(name)
