"""The one backoff rule: the wait before a retry doubles from `base` with each retry, up to `cap`.

Used by tool retries (`tools/decorators.py`) and, with full jitter, by model calls (`llm/adapter.py`).
"""

from __future__ import annotations


def exponential_backoff(base: float, retry: int, cap: float) -> float:
    """Seconds to wait before retry number `retry` (1, 2, ...): `base`, doubled each retry, at most `cap`."""
    return float(min(cap, base * (2 ** (retry - 1))))
