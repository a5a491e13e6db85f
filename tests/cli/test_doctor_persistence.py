"""`agents doctor` says what the state Redis's persistence loses of what it acknowledged: no AOF
(a restart loses everything) and `appendfsync everysec` (a crash of Redis during a slow fsync, or
a power cut) are warnings; `appendfsync always` is ok."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cli.process import agents, cli_env
from tests.support.redis_server import RedisServer


def persistence(redis_url: str, prefix: str, **env: str) -> dict[str, Any]:
    doc = agents("doctor", "--json", env=cli_env(redis_url, prefix, **env)).doc
    [check] = [c for c in doc["checks"] if c["name"] == "persistence"]
    return check  # type: ignore[no-any-return]


@pytest.fixture(params=["everysec", "always"])
def aof_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync=request.param).start()
    yield request.param, server.url
    server.stop(kill=True)


def test_doctor_says_what_the_aof_setting_loses(aof_redis: tuple[str, str], prefix: str) -> None:
    fsync, url = aof_redis
    check = persistence(url, prefix)
    if fsync == "always":
        assert check["severity"] == "ok" and check["ok"], check
        assert "nothing acknowledged is lost" in check["detail"]
        return
    assert check["severity"] == "warning" and not check["ok"], check
    detail = check["detail"]
    assert "a crash of Redis while a slow disk fsyncs loses up to ~2 s" in detail, detail
    assert "start, send and complete wait until Redis has written theirs" in detail
    assert "`appendfsync always` loses nothing" in detail
    # Asking for fsynced acknowledgements from a Redis without WAITAOF is said, not ignored.
    asked = persistence(url, prefix, AGENTS_ACK_FSYNC="1")["detail"]
    assert ("fsynced (AGENTS_ACK_FSYNC)" in asked) or ("AGENTS_ACK_FSYNC=1 needs WAITAOF, Redis ≥ 7.2" in asked), asked


def test_a_redis_without_aof_is_a_warning(redis_url: str, prefix: str) -> None:
    check = persistence(redis_url, prefix)
    assert check["severity"] == "warning", check
    assert "a restart of Redis loses every session and completion" in check["detail"]
