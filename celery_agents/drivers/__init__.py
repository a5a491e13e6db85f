"""How a session's steps run, apart from the API that asks for them: `InlineDriver` runs them (and
the calls they dispatch) in the calling process, `CeleryDriver` publishes them to the workers and
waits on the session's event stream. `Client` holds one of the two behind `StepDriver`."""

from celery_agents.drivers.base import EventHook, LocalRunners, Publisher, StepDriver
from celery_agents.drivers.celery import CeleryDriver
from celery_agents.drivers.inline import InlineDriver

__all__ = ["CeleryDriver", "EventHook", "InlineDriver", "LocalRunners", "Publisher", "StepDriver"]
