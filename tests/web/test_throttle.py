"""Guessing the API token of `agents serve`: wrong tokens are counted per real client (the socket
peer, or what a trusted proxy says in `X-Forwarded-For`), never per an address the client writes
itself; the right token is always served; and `serve` refuses a token short enough to guess on an
address other machines can reach. Real `agents serve` processes where uvicorn's handling of the
headers is what is tested, the app in process where only the `Guard` is."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.web.app import create_app
from celery_agents.web.security import (
    ADMIT_INTERVAL_S,
    AUTH_FAILURES_ALLOWED,
    MIN_TOKEN_CHARS,
    Throttle,
    check_bind,
)
from tests.cli.process import agents, cli_env
from tests.support.serve import Serve
from tests.web.conftest import serve_env

TOKEN = "a-right-token-long-enough-for-any-address"
BOUND = AUTH_FAILURES_ALLOWED


@pytest.fixture
def serving(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    """Start real `agents serve` processes with the token (and any other variables) given."""
    numbers = itertools.count()
    with contextlib.ExitStack() as stack:

        def start(host: str = "127.0.0.1", **extra: str) -> Serve:
            env = serve_env(redis_url, prefix, **{"AGENTS_API_TOKEN": TOKEN, **extra})
            return stack.enter_context(Serve(env, tmp_path / f"serve-{next(numbers)}.log", host=host))

        yield start


def guess(c: httpx.Client | TestClient, token: str, forwarded_for: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return c.get("/v1/sessions", headers=headers)


def assert_throttled(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "too_many_requests"
    assert set(r.json()["error"]) == {"code", "message"}
    assert int(r.headers["retry-after"]) > 0


def weighed(answers: list[httpx.Response]) -> int:
    """How many of these requests had their token looked at (a 429 was not)."""
    return sum(r.status_code != 429 for r in answers)


def test_rotating_x_forwarded_for_does_not_escape_the_throttle(serving: Callable[..., Serve]) -> None:
    """A guesser on the serve machine writes a new X-Forwarded-For with every guess."""
    server = serving()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        answers = [guess(c, f"guess-{i}", f"203.0.113.{i % 250 + 1}") for i in range(BOUND)]
        began = time.monotonic()
        answers += [guess(c, f"guess-{i}", f"203.0.113.{i % 250 + 1}") for i in range(BOUND, 200)]
        took = time.monotonic() - began
    assert [r.status_code for r in answers[:BOUND]] == [401] * BOUND
    late = answers[BOUND:]
    assert weighed(late) <= 1 + took / ADMIT_INTERVAL_S, f"{weighed(late)} guesses weighed in {took:.1f} s"
    for r in late:
        if r.status_code != 401:
            assert_throttled(r)


def test_a_throttled_client_has_one_token_weighed_a_second_and_its_right_one_gets_in_at_its_turn(
    serving: Callable[..., Serve],
) -> None:
    server = serving()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert [guess(c, f"guess-{i}").status_code for i in range(BOUND)] == [401] * BOUND
        began = time.monotonic()
        # Right and wrong tokens alike: a request past the budget learns something only if weighed.
        burst = [guess(c, TOKEN if i % 2 else f"more-{i}") for i in range(40)]
        took = time.monotonic() - began
        assert weighed(burst) <= 1 + took / ADMIT_INTERVAL_S, f"{weighed(burst)} tokens weighed in {took:.1f} s"
        refused = guess(c, TOKEN)
        if refused.status_code == 429:
            assert_throttled(refused)
            time.sleep(int(refused.headers["retry-after"]))  # what the answer asks of the client
            assert guess(c, TOKEN).status_code == 200, "the right token gets in at its turn"
        else:
            assert refused.status_code == 200


def test_x_forwarded_for_is_taken_from_a_trusted_proxy_only(serving: Callable[..., Serve]) -> None:
    """Behind a proxy on 127.0.0.1 every client shares the proxy's address: with the proxy
    trusted, each is counted as the address the proxy appended, whatever the client wrote before it."""
    server = serving(AGENTS_TRUSTED_PROXIES="127.0.0.0/8, ::1")
    guesser, neighbour = "198.51.100.7", "198.51.100.8"
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert [guess(c, f"guess-{i}", guesser).status_code for i in range(BOUND)] == [401] * BOUND
        assert_throttled(guess(c, "again", guesser))
        assert_throttled(guess(c, "again", f"{neighbour}, {guesser}")), "what the client wrote is not its address"
        assert guess(c, "wrong", neighbour).status_code == 401, "another client behind the proxy is not throttled"
        assert guess(c, TOKEN, neighbour).status_code == 200, "nor is its right token delayed"


def test_misses_in_another_addresss_name_throttle_the_guesser_only(settings: Settings) -> None:
    """An untrusted peer writes the victim's address into X-Forwarded-For: the misses are its own."""
    guard = app_with(settings)
    victim = "198.51.100.9"
    guesser = TestClient(guard, base_url="http://127.0.0.1:8765", client=("192.0.2.50", 4000))
    for i in range(BOUND + 5):
        assert guess(guesser, f"guess-{i}", victim).status_code in (401, 429)
    assert_throttled(guess(guesser, TOKEN, victim))
    person = TestClient(guard, base_url="http://127.0.0.1:8765", client=(victim, 4000))
    for i in range(5):
        assert guess(person, TOKEN).status_code == 200
        assert guess(person, "a typo").status_code == 401
        assert_throttled(guess(guesser, f"again-{i}"))


def test_the_right_token_of_another_client_is_never_delayed(settings: Settings) -> None:
    guard = app_with(settings)
    guesser = TestClient(guard, base_url="http://127.0.0.1:8765", client=("192.0.2.50", 4000))
    other = TestClient(guard, base_url="http://127.0.0.1:8765", client=("192.0.2.51", 4000))
    answers = []
    for i in range(200):
        guess(guesser, f"guess-{i}")
        answers.append(guess(other, TOKEN).status_code)
    assert answers == [200] * 200


def test_guesses_weighed_per_second_are_bounded_whatever_the_rate(settings: Settings) -> None:
    """600 guesses over 6 s (the throttle's clock), past the budget: one a second is weighed."""
    guard = app_with(settings)
    now = [1000.0]
    guard.throttle.clock = lambda: now[0]
    guesser = TestClient(guard, base_url="http://127.0.0.1:8765", client=("192.0.2.50", 4000))
    assert [guess(guesser, f"guess-{i}").status_code for i in range(BOUND)] == [401] * BOUND
    answers = []
    for i in range(600):
        now[0] += 0.01
        answers.append(guess(guesser, TOKEN if i == 450 else f"more-{i}"))
    assert 5 <= weighed(answers) <= 6, [i for i, r in enumerate(answers) if r.status_code != 429]
    assert answers[450].status_code == 429, "the right token was not weighed out of turn"
    now[0] += ADMIT_INTERVAL_S
    assert guess(guesser, TOKEN).status_code == 200


def app_with(settings: Settings, **overrides: Any) -> Any:
    settings = settings.replace(api_token=TOKEN, **overrides)
    return create_app(settings, Client(settings, inline=False))


def test_an_untrusted_peer_is_counted_as_itself_whatever_it_forwards(settings: Settings) -> None:
    app = app_with(settings, trusted_proxies=(ipaddress.ip_network("10.0.0.0/8"),))
    stranger = TestClient(app, base_url="http://127.0.0.1:8765", client=("192.0.2.50", 4000))
    answers = [guess(stranger, f"guess-{i}", f"10.0.0.{i % 250 + 1}").status_code for i in range(BOUND + 3)]
    assert answers == [401] * BOUND + [429] * 3


def test_a_chain_of_trusted_proxies_is_walked_to_the_client(settings: Settings) -> None:
    app = app_with(settings, trusted_proxies=(ipaddress.ip_network("10.0.0.0/8"),))
    proxy = TestClient(app, base_url="http://127.0.0.1:8765", client=("10.0.0.1", 4000))
    for i in range(BOUND):
        assert guess(proxy, f"guess-{i}", f"203.0.113.{i}, 198.51.100.7, 10.0.0.2").status_code == 401
    assert_throttled(guess(proxy, "again", "198.51.100.7, 10.0.0.3"))
    assert guess(proxy, "wrong", "198.51.100.8, 10.0.0.2").status_code == 401
    assert guess(proxy, "wrong", "not-an-address, 10.0.0.2").status_code == 401


def test_addresses_of_one_ipv6_64_are_one_client(settings: Settings) -> None:
    """An IPv6 host usually holds a whole /64: a new address per guess is no way around the bound."""
    app = app_with(settings)

    def from_address(address: str) -> TestClient:
        return TestClient(app, base_url="http://127.0.0.1:8765", client=(address, 4000))

    for i in range(BOUND):
        assert guess(from_address(f"2001:db8:0:1::{i + 1:x}"), f"guess-{i}").status_code == 401
    assert_throttled(guess(from_address("2001:db8:0:1:ffff::1"), "again"))
    assert guess(from_address("2001:db8:0:2::1"), "wrong").status_code == 401


def test_the_throttle_forgets_the_least_recent_clients_first_and_stays_bounded() -> None:
    throttle = Throttle(tracked=100)
    for _ in range(BOUND):
        throttle.missed("198.51.100.7")
    for i in range(10_000):
        throttle.missed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
        if i % 50 == 0:
            assert throttle.weigh("198.51.100.7") > 0, "a client still guessing stays throttled"
            throttle.missed("198.51.100.7")
    assert len(throttle) == 100


def test_serve_refuses_a_short_token_on_an_address_others_can_reach(redis_url: str, tmp_path: Path) -> None:
    env = cli_env(redis_url, "shorttoken", home=tmp_path, AGENTS_API_TOKEN="x")
    run = agents("serve", "--host", "0.0.0.0", "--port", "1", env=env)
    assert run.returncode == 2, run.stderr
    assert "AGENTS_API_TOKEN" in run.stderr and str(MIN_TOKEN_CHARS) in run.stderr
    for host in ("0.0.0.0", "::", "192.168.1.4", "example.com"):
        with pytest.raises(Exception, match="AGENTS_API_TOKEN"):
            check_bind(host, "y" * (MIN_TOKEN_CHARS - 1))
        check_bind(host, "y" * MIN_TOKEN_CHARS)
    check_bind("127.0.0.1", "x")  # on loopback only this machine's users can guess


def test_serve_starts_on_every_address_with_a_token_of_32_characters(serving: Callable[..., Serve]) -> None:
    server = serving(host="0.0.0.0", AGENTS_API_TOKEN="z" * MIN_TOKEN_CHARS)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert guess(c, "z" * MIN_TOKEN_CHARS).status_code == 200


def test_serve_refuses_trusted_proxies_that_are_not_networks(redis_url: str, tmp_path: Path) -> None:
    env = cli_env(redis_url, "badproxies", home=tmp_path, AGENTS_TRUSTED_PROXIES="10.0.0.0/8, nginx")
    run = agents("serve", "--port", "1", env=env)
    assert run.returncode == 2, run.stderr
    assert "AGENTS_TRUSTED_PROXIES" in run.stderr and "nginx" in run.stderr
    assert "Traceback" not in run.stderr


def test_serve_on_a_port_another_process_holds_says_so_and_exits_2(redis_url: str, tmp_path: Path) -> None:
    """Not "serving http://…" followed by uvicorn's bind error and exit 3 (not found)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        run = agents("serve", "--port", str(port), env=cli_env(redis_url, "taken", home=tmp_path))
    finally:
        taken.close()
    assert run.returncode == 2, run.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr and "in use" in run.stderr, run.stderr
    assert "serving http" not in run.stderr and "Traceback" not in run.stderr
