"""Signed agent specs (`AGENTS_SPEC_KEY`): whoever stores a spec signs it, whoever runs one checks.

A spec names commands and Python functions that workers run; without signatures, anyone who can
write to Redis can store one and have a worker run it. The signature is an HMAC-SHA256 over the
spec exactly as stored (its canonical JSON) with a key only the CLI, the API and the workers
hold; the key itself never goes to Redis.
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
