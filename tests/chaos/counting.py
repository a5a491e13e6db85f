"""A scripted model for failover tests: the runSync tool, then the runAsync one, then the answer;
requests counted per session (the prompt names it), each answered after `delay` so that steps are
in flight throughout."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from tests.support.llm_server import Reply, calls, text


class CountingModel:
    """Asks for the runSync tool, then the runAsync one, then answers; counts requests per session
    (the prompt names it) and answers after `delay`, so that steps are in flight throughout."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.per_session: Counter[str] = Counter()

    def __call__(self, body: dict[str, Any]) -> Reply:
        prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
        with self.lock:
            self.per_session[str(prompt)] += 1
        rounds = sum(1 for m in body["messages"] if m["role"] == "tool")
        if rounds == 0:
            return calls(("effect_sync", {"x": 1}), delay=self.delay)
        if rounds == 1:
            return calls(("effect_async", {"x": 2}), delay=self.delay)
        return text("done", delay=self.delay)

    @property
    def total(self) -> int:
        with self.lock:
            return sum(self.per_session.values())
