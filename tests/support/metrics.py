"""Prometheus text as a test reads it: `{'name{label="v",...}': value}`, labels sorted as
prometheus-client writes them."""

from __future__ import annotations


def parse_metrics(body: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
