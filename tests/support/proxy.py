"""A TCP proxy on 127.0.0.1 between clients and a Redis server, for faults that are not crashes.

It forwards bytes both ways and, on demand:
- `hang()`: stops forwarding (bytes are held, connections stay open) until `release()`, like a
  server or network that stalls;
- `drop_reply_to(marker)`: the next request whose bytes contain `marker` reaches the server, but
  its reply is thrown away and the client's connection closed, like a reply lost on the way back
  (the write happened; the client sees a connection error and may retry);
- `switch(port)`: later connections go to another server and open ones are closed, like a
  failover behind a stable address;
- `latency`: seconds every request waits before it goes up, like a distant or loaded server.

Each client connection gets its own upstream connection and two forwarding threads.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.support.redis_server import free_port

_CHUNK = 65536


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    #: the next reply on this connection is to be thrown away (a request with the marker went up)
    drop_next_reply: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class TcpProxy:
    """`TcpProxy(target_port).start()`; clients connect to `url` (or `port`)."""

    def __init__(self, target_port: int, port: int | None = None, latency: float = 0.0) -> None:
        self.target_port = target_port
        self.latency = latency
        self.port = port or free_port()
        self._pairs: list[_Pair] = []
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._marker: bytes | None = None
        self.dropped = threading.Event()
        self._listener: socket.socket | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- faults ------------------------------------------------------------------------------------
    def hang(self) -> None:
        """Hold every byte in both directions until `release()`."""
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def drop_reply_to(self, marker: bytes | str) -> threading.Event:
        """Lose the reply to the next request containing `marker` (once); the returned event is
        set when it happened."""
        with self._lock:
            self._marker = marker.encode() if isinstance(marker, str) else marker
            self.dropped = threading.Event()
            return self.dropped

    def switch(self, target_port: int) -> None:
        """Send new connections to another server; close the open ones."""
        with self._lock:
            self.target_port = target_port
            pairs, self._pairs = self._pairs, []
        for p in pairs:
            p.close()

    def close_all(self) -> None:
        """Cut every open connection (clients reconnect through the proxy)."""
        self.switch(self.target_port)

    # -- running ---------------------------------------------------------------------------------
    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped = True
        self._flowing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        self.close_all()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs.append(pair)
            threading.Thread(target=self._pump_up, args=(pair,), daemon=True).start()
            threading.Thread(target=self._pump_down, args=(pair,), daemon=True).start()

    def _chunks(self, src: socket.socket, pair: _Pair) -> Iterator[bytes]:
        while not pair.closed:
            try:
                data = src.recv(_CHUNK)
            except OSError:
                break
            if not data:
                break
            self._flowing.wait()
            if pair.closed:
                break
            yield data
        pair.close()

    def _pump_up(self, pair: _Pair) -> None:
        for data in self._chunks(pair.client, pair):
            with self._lock:
                if self._marker is not None and self._marker in data:
                    self._marker = None
                    pair.drop_next_reply = True
            if self.latency:
                time.sleep(self.latency)  # the fault itself: every request is late by this much
            try:
                pair.upstream.sendall(data)
            except OSError:
                pair.close()

    def _pump_down(self, pair: _Pair) -> None:
        for data in self._chunks(pair.upstream, pair):
            if pair.drop_next_reply:
                pair.close()
                self.dropped.set()
                return
            try:
                pair.client.sendall(data)
            except OSError:
                pair.close()
