"""A step's live output (`runtime/live.py`): how an answer's pieces become delta events."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery_agents.runtime.live import MAX_CHARS, SessionLive


class Deltas:
    """A store that keeps the batches of deltas written."""

    def __init__(self) -> None:
        self.settings = SimpleNamespace(stream_flush_ms=200)
        self.batches: list[list[tuple[str, str, int]]] = []

    def write_deltas(self, session_id: str, version: int, deltas: list[Any]) -> list[str]:
        self.batches.append(list(deltas))
        return [f"1-{i}" for i in range(len(deltas))]


def test_a_500_token_answer_arriving_at_once_is_one_delta_event() -> None:
    store = Deltas()
    live = SessionLive(store, "s1", 3)  # type: ignore[arg-type]
    answer = "word " * 500  # 2,500 characters, about 500 tokens
    assert live.max_chars == MAX_CHARS >= len(answer)
    live.write([("text", answer)])
    assert store.batches == [[("text_delta", answer, 0)]]


def test_a_longer_batch_is_split_into_events_of_at_most_max_chars_with_their_offsets() -> None:
    store = Deltas()
    live = SessionLive(store, "s1", 3)  # type: ignore[arg-type]
    live.write([("reasoning", "r" * 10), ("text", "t" * (MAX_CHARS + 5))])
    live.write([("text", "end")])
    assert [[(kind, len(text), offset) for kind, text, offset in batch] for batch in store.batches] == [
        [("reasoning_delta", 10, 0), ("text_delta", MAX_CHARS, 0), ("text_delta", 5, MAX_CHARS)],
        [("text_delta", 3, MAX_CHARS + 5)],
    ]
    assert live.ids == ["1-0", "1-1", "1-2", "1-0"]
