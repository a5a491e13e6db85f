"""Tools of the offline demo (`examples/demo-agent.json`): deterministic fake weather."""

from __future__ import annotations

import hashlib
from typing import Any

_CONDITIONS = ("sunny", "partly cloudy", "cloudy", "light rain", "windy")


def _seed(city: str) -> int:
    return int(hashlib.sha256(city.strip().lower().encode()).hexdigest()[:8], 16)


def get_weather(city: str) -> dict[str, Any]:
    """Current conditions in a city (made up, but always the same for the same city)."""
    s = _seed(city)
    return {"city": city, "temperature_c": 8 + s % 20, "conditions": _CONDITIONS[s % len(_CONDITIONS)]}


def get_forecast(city: str, days: int = 3) -> dict[str, Any]:
    """A few days of forecast for a city (made up, deterministic)."""
    s = _seed(city)
    names = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
    out = []
    for d in range(max(1, min(int(days), 7))):
        v = (s >> (d * 3)) % 97
        out.append(
            {
                "day": names[d],
                "high_c": 10 + v % 16,
                "low_c": 3 + v % 9,
                "conditions": _CONDITIONS[v % len(_CONDITIONS)],
            }
        )
    return {"city": city, "days": out}
