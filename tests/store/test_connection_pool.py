"""A steps process runs up to 200 steps at once on threads, each with its own Redis calls in flight:
the state client must hand every one of them a connection. redis-py 8 caps a pool at 100 unless
told otherwise, and the 101st call at once fails with "Too many connections"."""

from __future__ import annotations

import threading

from celery_agents.store import client_for_url
from celery_agents.tasks.supervisor import DEFAULT_STEP_THREADS
from tests.support.redis_server import RedisServer

AT_ONCE = DEFAULT_STEP_THREADS + 50


def test_more_calls_at_once_than_a_steps_process_has_threads_all_get_a_connection(
    redis_server: RedisServer, prefix: str
) -> None:
    client = client_for_url(redis_server.url)
    errors: list[BaseException] = []
    # Every thread blocks in BLPOP on its own key until the push below: all hold a connection at once.
    waiting = threading.Barrier(AT_ONCE + 1, timeout=60)

    def wait_on(i: int) -> None:
        try:
            client.set(f"{prefix}:pool:{i}:ready", 1)
            waiting.wait()
            assert client.blpop([f"{prefix}:pool:{i}"], timeout=10) is not None
        except BaseException as e:
            errors.append(e)
            waiting.abort()

    threads = [threading.Thread(target=wait_on, args=(i,), daemon=True) for i in range(AT_ONCE)]
    for t in threads:
        t.start()
    try:
        waiting.wait()
        # Wait until all are inside BLPOP (CLIENT LIST counts the blocked connections), then wake them.
        admin = client_for_url(redis_server.url)
        for _ in range(600):
            if sum(1 for c in admin.client_list() if c["cmd"] == "blpop") >= AT_ONCE or errors:
                break
            threading.Event().wait(0.05)
        for i in range(AT_ONCE):
            admin.rpush(f"{prefix}:pool:{i}", "go")
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join(timeout=60)
    assert not errors, f"{len(errors)} of {AT_ONCE} calls failed: {errors[0]!r}"
    client.close()
