"""The `steps` queue on a Redis broker is consumed without acknowledgement, and a step's request
then acknowledges and rejects nothing in the broker; tool calls keep late acknowledgement and are
requeued when their worker dies; another broker (AMQP) keeps acknowledgements for steps too."""

from __future__ import annotations

from typing import Any
from unittest.mock import Mock

from celery import Celery
from celery.contrib.testing.mocks import TaskMessage

from celery_agents.config import Settings
from celery_agents.tasks.config import CALL_TASK, STEP_TASK, make_app
from celery_agents.tasks.step import StepRequest

REDIS = Settings(redis_url="redis://127.0.0.1:6379/0")
AMQP = Settings(redis_url="redis://127.0.0.1:6379/0", broker_url="amqp://guest@127.0.0.1//")


def test_on_redis_steps_are_taken_without_acknowledgement_and_tool_calls_with() -> None:
    app = make_app(REDIS)
    queues = app.amqp.queues
    assert [(q.name, q.exchange.name, q.exchange.type, q.routing_key) for q in map(queues.get, queues)] == [
        ("steps", "steps", "direct", "steps"),
        ("tools", "tools", "direct", "tools"),
        ("isolated", "isolated", "direct", "isolated"),
    ]
    assert queues["steps"].no_ack
    assert not queues["tools"].no_ack and not queues["isolated"].no_ack
    assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost
    assert app.conf.worker_disable_prefetch, "a worker takes a step only when a thread is free"


def test_publishers_route_steps_and_calls_as_before() -> None:
    app = make_app(REDIS)
    router = app.amqp.router
    assert router.route({}, STEP_TASK)["queue"].name == "steps"
    assert router.route({}, CALL_TASK)["queue"].name == "tools"
    # The bench's yardsticks name a queue of their own: made as before, acknowledged late.
    assert not app.amqp.queues["bare"].no_ack


def test_another_broker_keeps_acknowledging_steps() -> None:
    assert not make_app(AMQP).amqp.queues["steps"].no_ack


def _request(app: Celery, queue: str) -> tuple[StepRequest, Mock, Mock]:
    message: Any = TaskMessage(STEP_TASK, args=("s1", 1, ""))
    message.delivery_info = {"exchange": queue, "routing_key": queue}
    on_ack, on_reject = Mock(), Mock()
    task = Mock(acks_late=True, ignore_result=True, send_events=False)
    req = StepRequest(message, app=app, task=task, on_ack=on_ack, on_reject=on_reject)
    return req, on_ack, on_reject


def test_a_step_taken_without_acknowledgement_is_acknowledged_without_the_broker() -> None:
    req, on_ack, on_reject = _request(make_app(REDIS), "steps")
    req.acknowledge()
    assert req.acknowledged and not on_ack.called
    req, on_ack, on_reject = _request(make_app(REDIS), "steps")
    req.reject(requeue=True)
    assert req.acknowledged and not on_reject.called and not on_ack.called


def test_a_step_from_an_acknowledged_queue_is_acknowledged_through_the_broker() -> None:
    for app, queue in ((make_app(AMQP), "steps"), (make_app(REDIS), "tools")):
        req, on_ack, on_reject = _request(app, queue)
        req.acknowledge()
        assert req.acknowledged and on_ack.call_count == 1
        req, on_ack, on_reject = _request(app, queue)
        req.reject(requeue=True)
        assert on_reject.call_count == 1 and on_reject.call_args.args[2] is True
