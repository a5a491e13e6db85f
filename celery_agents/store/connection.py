"""Opening the Redis that holds sessions: `AGENTS_REDIS_URL`, or the embedded local default."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from celery_agents.config import Settings
from celery_agents.store.embedded import EmbeddedRedis

#: Connections one client may open at once. A steps process runs up to 200 steps on threads (more
#: with `--step-threads`), each with a Redis call in flight; redis-py 8 caps a pool at 100 unless
#: told otherwise and fails the 101st call at once ("Too many connections"). Redis's own
#: `maxclients` defaults to 10,000: the pool opens only what its threads use at once.
MAX_CONNECTIONS = 10_000


def client_for_url(url: str) -> redis.Redis:
    """A client for a `redis://`, `rediss://` or `unix://` URL (passwords and ACL users included)."""
    return redis.Redis.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        # The version CLIENT SETINFO reports, given rather than looked up in the installed
        # packages' metadata (importlib.metadata) by every new connection: ~5 ms of a CLI start.
        driver_info=redis.DriverInfo(lib_version=redis.__version__),
        decode_responses=True,
        socket_connect_timeout=5,
        socket_timeout=30,
        health_check_interval=25,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def state_url(settings: Settings) -> str:
    """The Redis that holds sessions: `AGENTS_REDIS_URL`, else the embedded one's unix socket."""
    return settings.redis_url or EmbeddedRedis(settings.home).url


def broker_url(settings: Settings) -> str:
    """The Celery broker: `AGENTS_BROKER_URL`, else the state Redis (a unix socket as kombu names it)."""
    if settings.broker_url:
        return settings.broker_url
    url = state_url(settings)
    return "redis+socket://" + url[len("unix://") :] if url.startswith("unix://") else url
