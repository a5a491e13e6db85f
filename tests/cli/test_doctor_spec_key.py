"""`agents doctor` warns when agent specs are not signed on a Redis other than the embedded one
(whoever can write to it could make workers run their code), and says so without failing."""

from __future__ import annotations

from pathlib import Path

from tests.cli.process import agents, cli_env


def spec_check(doc: dict[str, object]) -> dict[str, object]:
    [check] = [c for c in doc["checks"] if c["name"] == "spec signing"]  # type: ignore[attr-defined]
    return check  # type: ignore[no-any-return]


def test_doctor_warns_without_a_spec_key_and_is_quiet_with_one(redis_url: str, prefix: str) -> None:
    bare = agents("doctor", "--json", env=cli_env(redis_url, prefix))
    check = spec_check(bare.doc)
    assert check["ok"] is False and "AGENTS_SPEC_KEY" in str(check["detail"])
    keyed = agents("doctor", "--json", env=cli_env(redis_url, prefix, AGENTS_SPEC_KEY="s3cret-spec-key"))
    assert spec_check(keyed.doc)["ok"] is True
    assert "s3cret-spec-key" not in keyed.stdout + keyed.stderr
    human = agents("doctor", env=cli_env(redis_url, prefix))
    assert "AGENTS_SPEC_KEY is unset" in human.stdout + human.stderr


def test_the_embedded_redis_needs_no_spec_key(prefix: str, tmp_path: Path) -> None:
    doc = agents("doctor", "--json", env=cli_env(None, prefix, tmp_path / "home")).doc
    assert not [c for c in doc["checks"] if c["name"] == "spec signing"]
