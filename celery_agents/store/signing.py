"""Signed agent specs (`AGENTS_SPEC_KEY`): whoever stores a spec signs it, whoever runs one checks.

A spec names commands and Python functions that workers run; without signatures, anyone who can
write to Redis can store one and have a worker run it. The signature is an HMAC-SHA256 over the
spec exactly as stored (its canonical JSON) with a key only the CLI, the API and the workers
hold; the key itself never goes to Redis.

The same key seals what makes a call run without its own step deciding it: an approval recorded
on a token (complete_token.lua keeps the seal beside the decision) and a session's grants. A
worker honours neither without its seal, so a Redis writer cannot approve by writing the record:
only by going through a holder of the key, as any completer does (the completions stream).
"""

from __future__ import annotations

import hashlib
import hmac


def sign_spec(key: str, spec_json: str) -> str:
    """The signature stored beside a spec."""
    return hmac.new(key.encode(), spec_json.encode(), hashlib.sha256).hexdigest()


def spec_verifies(key: str, spec_json: str, signature: str | None) -> bool:
    """Whether `signature` is the key's signature of `spec_json` (compared in constant time)."""
    return signature is not None and hmac.compare_digest(sign_spec(key, spec_json), signature)


def seal(key: str, purpose: str, *parts: str) -> str:
    """The key's HMAC-SHA256 of `parts` for `purpose` (a decision, a grant): what a record written
    through a holder of the key carries, and a Redis writer without the key cannot make."""
    message = "\x00".join((purpose, *parts))
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()


def seal_verifies(key: str, given: str | None, purpose: str, *parts: str) -> bool:
    """Whether `given` is the key's seal of `parts` for `purpose` (compared in constant time)."""
    return bool(given) and hmac.compare_digest(seal(key, purpose, *parts), str(given))


def decision_seal(key: str, token: str, approved: str) -> str:
    """The seal of an approval recorded on `token`: `approved` is what the approval records for
    the call until it has run (an approval gate's approved arguments; '' for a deferred delegation
    approved by a completion)."""
    return seal(key, "decision", token, approved)


def sealed_grant(key: str | None, session_id: str, tool: str, digest: str) -> str:
    """What a session's `grants` holds for `tool` granted on its schema `digest`: the digest, and
    with a key its seal (`<digest>:<seal>`)."""
    return f"{digest}:{seal(key, 'grant', session_id, tool, digest)}" if key else digest


def trusted_grants(key: str | None, session_id: str, grants: dict[str, str]) -> dict[str, str]:
    """The grants (tool -> schema digest) a worker honours: with a key, only those whose seal
    verifies (one written into Redis by hand is none); without, every one."""
    out = {}
    for tool, value in grants.items():
        digest, _, given = str(value).partition(":")
        if key is None or seal_verifies(key, given, "grant", session_id, tool, digest):
            out[tool] = digest
    return out
