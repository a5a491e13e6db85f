"""What JSON from outside (agent files, results, tool output, model arguments) may look like.

Python's parser turns a deeply nested document into a `RecursionError` and an integer of more
than 4,300 digits into a bare `ValueError`, and deep values that do parse break later code that
walks them. `load_json` parses such text into a value every part of celery-agents can handle, or
raises `UnusableJson` saying what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: nesting deeper than this (objects and lists) is refused; nothing we read needs more
MAX_DEPTH = 100


class UnusableJson(ValueError):
    """Text that is JSON but not JSON celery-agents can use (too deep, a number too long)."""


def load_json(text: str | bytes) -> Any:
    """The JSON value of `text`. Raises `json.JSONDecodeError` for text that is not JSON and
    `UnusableJson` for JSON nested deeper than MAX_DEPTH or holding a number too long to read."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise UnusableJson(f"it is nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # Python refuses integers of more than 4,300 digits
        raise UnusableJson(f"it holds a number too long to read ({exc})") from None
    check_depth(value)
    return value


#: a UTF-16 surrogate alone: JSON's `\\ud800` escape parses to it, and no UTF-8 text can hold it
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_depth(value: Any) -> None:
    """Raise `UnusableJson` when `value` nests lists and objects deeper than MAX_DEPTH, or holds
    text with a lone surrogate (`"\\ud800"` parses, but Redis, files and the model get UTF-8)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                raise UnusableJson("it holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")
            continue
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            raise UnusableJson(f"it is nested deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)
