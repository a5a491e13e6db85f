"""What litellm's price list says a model's tokens cost, for bounding a call's cost before it is
made (runtime/budget.py). Looked up once per model and process; a model litellm cannot price
costs nothing known (as its calls' cost is then unknown, and counted as 0)."""

from __future__ import annotations

import threading

from celery_agents.llm.adapter import ensure_litellm

_known: dict[str, tuple[float, float]] = {}
_lock = threading.Lock()
#: models looked up in a process at most (a bound on the cache; an agent names a few)
_MAX_MODELS = 1024


def price_per_token(model: str) -> tuple[float, float]:
    """US dollars per prompt token and per completion token of `model`; (0, 0) when unpriced."""
    with _lock:
        found = _known.get(model)
    if found is not None:
        return found
    litellm = ensure_litellm()
    try:
        info = litellm.get_model_info(model)
        found = (float(info.get("input_cost_per_token") or 0.0), float(info.get("output_cost_per_token") or 0.0))
    except Exception:  # litellm raises for a model it has no price for
        found = (0.0, 0.0)
    with _lock:
        if len(_known) < _MAX_MODELS:
            _known[model] = found
    return found
