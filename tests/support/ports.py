"""Free ports for the servers tests start (redis-server, sentinels, a Cluster's nodes and buses,
HTTP servers). A port is picked at random below the kernel's ephemeral range and checked free:
a port the kernel hands out for binding port 0 comes from that range, which every outgoing
connection of the suite takes its local port from too, so between the pick and the server's bind
a client's connection could take it ("Address already in use": a server that never answered). A port is
never handed out twice in one process (a Cluster picks twelve before any server binds one); a
port another test process picks at the same moment is what `RedisServer.start` retries."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_pick = random.SystemRandom()
_given: set[int] = set()


def _below_ephemeral() -> tuple[int, int]:
    try:
        low = int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(1024, low - 12_000), low


def free_port() -> int:
    """A port nothing listens on now, out of the range outgoing connections take theirs from."""
    low, high = _below_ephemeral()
    for _ in range(200):
        port = _pick.randrange(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _given.add(port)
            return port
    with socket.socket() as s:  # the whole range busy: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
