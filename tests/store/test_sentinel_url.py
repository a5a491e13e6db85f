"""`AGENTS_REDIS_URL=redis+sentinel://[:PW@]HOST:26379[,HOST:26379…]/MASTER/DB` (and `rediss+…`
for TLS): what the state client and the Celery broker are made of, and what is refused."""

from __future__ import annotations

import ssl
import time

import pytest
from redis.sentinel import SentinelConnectionPool

from celery_agents.config import Settings
from celery_agents.errors import RedisUnavailable
from celery_agents.redis_urls import parse_sentinel_url
from celery_agents.store import broker_url, client_for_url
from celery_agents.store.connection import broker_options
from celery_agents.tasks.config import make_app, steps_unacknowledged
from tests.support.ports import free_port


def test_a_sentinel_url_names_every_sentinel_the_master_the_database_and_the_credentials() -> None:
    url = parse_sentinel_url("redis+sentinel://app:s%40cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/main/3")
    assert url.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert (url.master, url.db, url.username, url.password, url.tls) == ("main", 3, "app", "s@cret", False)


def test_the_database_defaults_to_zero_and_a_password_alone_is_accepted() -> None:
    url = parse_sentinel_url("redis+sentinel://:pw@h:26379/main")
    assert (url.master, url.db, url.username, url.password) == ("main", 0, None, "pw")


def test_rediss_sentinel_is_tls_with_the_certificate_options_of_the_query() -> None:
    url = parse_sentinel_url("rediss+sentinel://h:26379/main/0?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem")
    assert url.tls
    assert url.ssl_options == {"ssl_cert_reqs": ssl.CERT_NONE, "ssl_ca_certs": "/etc/ca.pem"}


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://h:26379", "MASTER"),
        ("redis+sentinel:///main/0", "HOST"),
        ("redis+sentinel://h:26379/main/x", "DB"),
        ("redis+sentinel://h:notaport/main", "port"),
        ("redis+sentinel://h:26379/main/0/extra", "MASTER/DB"),
        ("redis+sentinel://h:26379/main?colour=blue", "colour"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_saying_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        parse_sentinel_url(url)
    assert "redis+sentinel://" in str(caught.value), "the message shows the form expected"


def test_the_state_client_asks_the_sentinels_for_the_master_and_keeps_its_pool_settings() -> None:
    client = client_for_url("redis+sentinel://:pw@127.0.0.1:26379,127.0.0.1:26380/main/2")
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)  # nothing is connected yet: made without a server
    assert pool.service_name == "main" and pool.is_master
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["password"], kwargs["decode_responses"]) == (2, "pw", True)
    assert pool.max_connections == 10_000
    sentinels = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(s["host"], s["port"]) for s in sentinels] == [("127.0.0.1", 26379), ("127.0.0.1", 26380)]
    assert all(s.get("password") is None for s in sentinels), "the URL's password is the data nodes'"


def test_sentinels_with_a_password_of_their_own_get_it_from_the_query() -> None:
    client = client_for_url("redis+sentinel://:pw@h:26379/main/0?sentinel_password=spw")
    (sentinel,) = client.connection_pool.sentinel_manager.sentinels
    assert sentinel.connection_pool.connection_kwargs["password"] == "spw"


def test_the_queues_follow_the_same_sentinels_through_kombus_sentinel_transport() -> None:
    settings = Settings(redis_url="redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/main/2")
    assert broker_url(settings) == "sentinel://:pw@10.0.0.1:26379/2;sentinel://:pw@10.0.0.2:26380/2"
    conf = make_app(settings).conf
    assert conf.broker_transport_options["master_name"] == "main"
    assert conf.broker_transport_options["global_keyprefix"] == "agents:celery:"
    assert not conf.broker_use_ssl
    assert steps_unacknowledged(conf.broker_url), "kombu's sentinel transport is its Redis transport"


def test_a_sentinel_broker_url_of_its_own_wins_over_the_state_one() -> None:
    settings = Settings(redis_url="redis+sentinel://h1:26379/state/0", broker_url="redis+sentinel://h2:26379/queues/1")
    assert broker_url(settings) == "sentinel://h2:26379/1"
    assert broker_options(settings)["master_name"] == "queues"


def test_tls_sentinels_give_the_broker_tls_to_the_master_and_to_the_sentinels() -> None:
    settings = Settings(redis_url="rediss+sentinel://h:26379/main/0?ssl_cert_reqs=required")
    conf = make_app(settings).conf
    assert conf.broker_use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    sentinel_kwargs = conf.broker_transport_options["sentinel_kwargs"]
    assert sentinel_kwargs["ssl"] is True and sentinel_kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED


def test_plain_redis_urls_are_unchanged() -> None:
    settings = Settings(redis_url="redis://u:p@127.0.0.1:6379/4")
    assert broker_url(settings) == "redis://u:p@127.0.0.1:6379/4"
    assert "master_name" not in make_app(settings).conf.broker_transport_options


def test_sentinels_out_of_reach_are_passed_over_at_once_and_named_plainly() -> None:
    """No sentinel answers: the state client says so in a few seconds (each dead sentinel is
    passed over at once, not retried with a backoff: the sentinels are several), and its message
    names each sentinel by its address, not by the client's repr with its object ids."""
    dead = [free_port(), free_port()]
    client = client_for_url(f"redis+sentinel://127.0.0.1:{dead[0]},127.0.0.1:{dead[1]}/mymaster")
    began = time.monotonic()
    with pytest.raises(RedisUnavailable) as caught:
        client.ping()
    took = time.monotonic() - began
    message = str(getattr(caught.value, "message", ""))
    assert message.startswith("cannot reach Redis: No master found for 'mymaster'"), message
    assert f"sentinel 127.0.0.1:{dead[0]}" in message and f"sentinel 127.0.0.1:{dead[1]}" in message, message
    assert " at 0x" not in message and "<redis" not in message, message
    assert took < 5, f"{took:.1f} s to find that no sentinel answers (33 s with redis-py's default retries)"
