"""The test harness's own servers: a port another process binds between the pick and the server's
bind must not fail the test that wanted the server (it failed a CI run: "redis-server on port N
did not start" for one node of a Cluster)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from celery_agents.store.embedded import redis_server_binary
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer


def _taken() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", free_port()))
    s.listen()
    return s


def test_a_picked_port_someone_else_bound_first_is_picked_again(tmp_path: Path) -> None:
    with _taken() as other, _taken() as other_bus:
        extra = ["--cluster-enabled", "yes", "--cluster-port", "0"]
        server = RedisServer(tmp_path / "r", extra=extra, binary=redis_server_binary(("system", "path")))
        server.port = other.getsockname()[1]  # the race: picked free, bound by another before the server
        server.extra[-1] = str(other_bus.getsockname()[1])
        server.start()
        try:
            assert server.port != other.getsockname()[1]
            assert redis.Redis(port=server.port).ping()
        finally:
            server.stop(kill=True)


def test_a_port_the_test_named_is_not_changed_and_the_error_shows_the_log(tmp_path: Path) -> None:
    with _taken() as other:
        server = RedisServer(tmp_path / "r", port=other.getsockname()[1])
        with pytest.raises(RuntimeError, match="Address already in use"):
            server.start()


def test_one_process_is_never_handed_the_same_port_twice() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
