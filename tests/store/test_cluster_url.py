"""`AGENTS_REDIS_URL=redis+cluster://[USER:PW@]HOST:PORT[,HOST:PORT…]` (and `rediss+…` for TLS):
what it names, what is refused, what it implies (16 index shards, writes waiting for a replica),
and that the queues are never put on it (`BrokerMissing`)."""

from __future__ import annotations

import ssl

import pytest

from celery_agents.config import Settings
from celery_agents.errors import BrokerMissing
from celery_agents.redis_urls import is_cluster_url, parse_cluster_url
from celery_agents.store import broker_url


def test_a_cluster_url_names_its_nodes_and_credentials() -> None:
    url = parse_cluster_url("redis+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2,[::1]:7001")
    assert url.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7001))
    assert (url.username, url.password, url.tls) == ("app", "s@cret", False)
    assert is_cluster_url("REDIS+CLUSTER://h:1") and not is_cluster_url("redis://h:1")


def test_rediss_cluster_is_tls_with_the_certificate_options_of_the_query() -> None:
    url = parse_cluster_url("rediss+cluster://h:7000?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem")
    assert url.tls and url.ssl_options == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ca.pem"}


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+cluster://", "no HOST:PORT"),
        ("redis+cluster://h:7000/3", "database 0 only"),
        ("redis+cluster://h:port", "not a port"),
        ("redis+cluster://h:7000?db=1", "unknown option db"),
        ("redis://h:7000", "not a Cluster URL"),
    ],
)
def test_what_a_cluster_url_cannot_be_is_refused_naming_the_form(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        parse_cluster_url(url)
    assert "redis+cluster://[USER:PASSWORD@]HOST:PORT" in str(caught.value)


def test_a_cluster_means_sixteen_index_shards_and_writes_waiting_for_a_replica() -> None:
    on = Settings(redis_url="redis+cluster://h:7000")
    assert (on.cluster, on.shards, on.replicas_to_ack) == (True, 16, 1)
    assert Settings(redis_url="redis+cluster://h:7000", index_shards=64, ack_replicas=0).shards == 64
    plain = Settings(redis_url="redis://h:6379/0")
    assert (plain.cluster, plain.shards, plain.replicas_to_ack) == (False, 1, 0)
    assert Settings().shards == 1


def test_queues_never_go_on_the_cluster() -> None:
    with pytest.raises(BrokerMissing, match="AGENTS_BROKER_URL") as caught:
        broker_url(Settings(redis_url="redis+cluster://h:7000"))
    assert caught.value.exit_code == 2
    given = Settings(redis_url="redis+cluster://h:7000", broker_url="amqp://u:p@rabbit:5672/v")
    assert broker_url(given) == "amqp://u:p@rabbit:5672/v"


def test_a_bad_certificate_option_names_the_cluster_form() -> None:
    with pytest.raises(ValueError, match="invalid Cluster URL: ssl_cert_reqs='maybe'"):
        parse_cluster_url("rediss+cluster://h:7000?ssl_cert_reqs=maybe")
