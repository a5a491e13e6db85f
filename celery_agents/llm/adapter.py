"""Calling a model through litellm: request in, `LlmTurn` out, failures classified and retried.

Retries happen here only (the SDK's own retries are switched off): transient failures are retried
with exponential backoff and full jitter within one budget per step; a rate limit that says when to
ask again (429 with `Retry-After`) is not waited for here, it fails the call with `retry_after` set
and the runtime puts the step back until then, pausing the model for the fleet. A
call that goes over the network runs as a coroutine on the process's model loop while the step's
thread waits for it (`llm/loop.py`); the offline demo model is answered on the step's thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from celery_agents import observe
from celery_agents.backoff import exponential_backoff
from celery_agents.config import Settings
from celery_agents.llm import wire
from celery_agents.llm.errors import classify
from celery_agents.llm.loop import wait_on_loop
from celery_agents.llm.offline import is_offline, live_parts, register_offline_model
from celery_agents.llm.stream import Answer, Interrupted, Relay, await_answer
from celery_agents.model import LlmTurn, ToolCall, Usage
from celery_agents.scheduler.ports import LiveOutput, LlmFailure, LlmInterrupted, LlmRequest

_setup_lock = threading.Lock()
_ready = False

#: litellm's switch, read at every call, that sends a request to an OpenAI-compatible endpoint
#: through litellm's own HTTP handler instead of the OpenAI SDK. The same request and the same
#: answer, parsed by the same `OpenAIGPTConfig`, for about a fifth less CPU per call: the SDK's
#: request building, its response models and its httpx layer over litellm's aiohttp transport are
#: skipped (`bench/probes/http_call.py`: 3.6 → 2.9 ms per call). What the session keeps of an
#: answer or a failure is the same on both routes (`tests/llm/test_http_route.py`), and on this one
#: a streamed answer is read off the wire, at a fraction of litellm's CPU (`llm/wire.py`); the SDK's
#: telemetry headers are not sent, and an `organization` is sent as the header the SDK would send.
#: Set to `false` in the worker's environment to keep the SDK; left off when `OPENAI_ORGANIZATION`
#: is set, which only the SDK reads.
HTTP_ROUTE_VARIABLE = "EXPERIMENTAL_OPENAI_BASE_LLM_HTTP_HANDLER"


def _http_route() -> bool:
    return os.environ.get(HTTP_ROUTE_VARIABLE, "").strip().lower() in ("true", "1", "yes")


def ensure_litellm() -> Any:
    """Import litellm once, offline-friendly and quiet, with the offline providers registered."""
    global _ready
    with _setup_lock:
        if not _ready:
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            os.environ.setdefault("LITELLM_LOG", "ERROR")
            if not os.environ.get("OPENAI_ORGANIZATION"):  # the HTTP route would not send it
                os.environ.setdefault(HTTP_ROUTE_VARIABLE, "true")
            import litellm

            from celery_agents.llm.offline import register_offline_providers

            for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "litellm"):
                logging.getLogger(name).setLevel(logging.WARNING)
            litellm.suppress_debug_info = True
            litellm.telemetry = False
            register_offline_providers(litellm)
            if not isinstance(litellm.response_cost_calculator, UnpricedModels):
                litellm.response_cost_calculator = UnpricedModels(litellm, litellm.response_cost_calculator)
            _ready = True
    import litellm

    return litellm


#: the longest model name (the agent file's or the answer's) whose missing price is remembered
MODEL_NAME_LIMIT = 256

#: a provider that prices its answers itself says so in this header, which litellm prefers to its map
_REPORTED_COST_HEADER = "llm_provider-x-litellm-response-cost"


class UnpricedModels:
    """litellm's `response_cost_calculator`, remembering the models it found no price for.

    After every call litellm prices the answer from its price map. For a model the map does not
    have (a self-hosted server behind `apiBase`, mostly) it first searches every generalisation of
    the name, then raises `ModelNotMappedError`, which it catches and reports as no cost: 0.5 to 1.5 ms
    of CPU per call, a tenth of a steps process's CPU with 1,000 sessions in flight. The answer
    depends only on the model, its provider, what else the call asked to be priced by and the map;
    so once a model raised, the same question raises the same error at once (or, while no callback
    listens, answers no cost at once), and litellm carries on exactly as before: no cost. Not remembered: calls with
    custom pricing, cache hits, answers whose provider reported their cost, names longer than
    `MODEL_NAME_LIMIT` (the answer's comes from the server), and anything that did not raise; at
    most `LIMIT` questions are kept. Registering a price (`litellm.register_model`) grows the map,
    which is part of the question, so the model is priced from the next call on."""

    LIMIT = 1024

    def __init__(self, litellm: Any, original: Callable[..., Any]) -> None:
        self.litellm = litellm
        self.original = original
        self.not_mapped: type[Exception] = litellm.exceptions.ModelNotMappedError
        self.known: dict[tuple[object, ...], str] = {}

    def __call__(self, **kwargs: Any) -> Any:
        key = self._question(kwargs)
        message = self.known.get(key) if key is not None else None
        if message is not None:
            if not listened(self.litellm):
                # No cost, as the error gives; without it litellm also skips the diagnosis of a
                # zero cost it makes for its callbacks (another search of the price map, ~8 % of
                # a call's CPU), which nobody reads while no callback listens.
                return None
            raise self.not_mapped(message)
        try:
            return self.original(**kwargs)
        except self.not_mapped as exc:
            if key is not None:
                if len(self.known) >= self.LIMIT:
                    self.known.clear()
                self.known[key] = str(exc)
            raise

    def _question(self, kw: dict[str, Any]) -> tuple[object, ...] | None:
        if kw.get("cache_hit") or kw.get("custom_pricing") or kw.get("custom_cost_per_token"):
            return None
        if len(str(kw.get("model") or "")) > MODEL_NAME_LIMIT:
            return None
        if kw.get("custom_cost_per_second") is not None or kw.get("requested_model_info_override"):
            return None
        response = kw.get("response_object")
        hidden = getattr(response, "_hidden_params", None)
        if isinstance(hidden, dict):
            headers = hidden.get("additional_headers")
        else:
            headers = getattr(hidden, "additional_headers", None)
        if isinstance(headers, dict) and _REPORTED_COST_HEADER in headers:
            return None
        # The answer's name for its model comes from the server (untrusted): kept only when short.
        answered = getattr(response, "model", None)
        if answered is not None and (not isinstance(answered, str) or len(answered) > MODEL_NAME_LIMIT):
            return None
        return (
            kw.get("model"),
            kw.get("custom_llm_provider"),
            kw.get("base_model"),
            kw.get("call_type"),
            kw.get("router_model_id"),
            kw.get("pricing_provider"),
            kw.get("service_tier"),
            kw.get("data_residency"),
            kw.get("vertex_location"),
            kw.get("region_name"),
            type(response).__name__,
            answered,
            len(self.litellm.model_cost),
        )


def warm_up() -> None:
    """One offline model call, so that litellm's lazy imports happen once in a worker's parent
    process instead of in every forked pool process."""
    from celery_agents.model import AgentSpec

    with contextlib.suppress(Exception):
        LitellmPort(RetryPolicy(attempts=1)).complete(
            LlmRequest(
                agent=AgentSpec(slug="warm-up", model="demo/warm-up"),
                messages=[{"role": "user", "content": "warm up"}],
                tools=[],
            )
        )


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried within one step."""

    attempts: int = 4
    backoff: float = 1.0
    max_backoff: float = 30.0
    #: a model call may take this long before it counts as a transient timeout
    timeout: float = 120.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        return cls.from_settings(Settings.from_env())

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(
            attempts=settings.llm_attempts,
            backoff=settings.llm_backoff,
            max_backoff=settings.llm_max_backoff,
            timeout=settings.llm_timeout,
        )

    def delay(self, attempt: int, retry_after: float | None) -> float:
        computed = random.uniform(0, exponential_backoff(self.backoff, attempt, self.max_backoff))
        if retry_after is not None:
            return min(max(retry_after, computed), self.max_backoff)
        return computed


#: what goes as the key to an `apiBase` the agent file names without an `apiKeyEnv`: local
#: OpenAI-compatible servers accept anything, and the SDKs refuse to run without a key
NO_KEY = "no-key"


def _api_key(model: str, api_base: str | None, api_key_env: str | None, slug: str) -> str | None:
    """The key sent with a model call. Keys go only to their provider: the variable `apiKeyEnv`
    names goes wherever the agent file points; without one, a custom `apiBase` gets a placeholder
    and never the worker's own provider keys (litellm would otherwise send e.g. OPENAI_API_KEY to
    any endpoint); with neither, litellm's environment defaults go to the provider's endpoint."""
    if api_key_env:
        value = os.environ.get(api_key_env)
        if not value:
            raise LlmFailure(
                "missing_api_key",
                f"the environment variable {api_key_env} (apiKeyEnv of agent {slug!r}, model {model}) is not set "
                "in the worker's environment",
                transient=False,
            )
        return value
    if api_base:
        return NO_KEY
    return None


def usage_of(u: Any, cost: Any) -> Usage:
    """litellm's usage object (and the call's cost, when known) as a turn records it."""
    usage = Usage()
    if u is not None:
        details = getattr(u, "completion_tokens_details", None)
        pdetails = getattr(u, "prompt_tokens_details", None)
        usage = Usage(
            prompt_tokens=int(getattr(u, "prompt_tokens", 0) or 0),
            completion_tokens=int(getattr(u, "completion_tokens", 0) or 0),
            total_tokens=int(getattr(u, "total_tokens", 0) or 0),
            reasoning_tokens=int(getattr(details, "reasoning_tokens", 0) or 0) if details else 0,
            cached_tokens=int(getattr(pdetails, "cached_tokens", 0) or 0) if pdetails else 0,
        )
    if cost is not None:
        usage = usage.model_copy(update={"cost": float(cost)})
    return usage


def to_llm_turn(response: Any, duration_ms: float, now: float) -> LlmTurn:
    """Map a litellm `ModelResponse` to an `LlmTurn`."""
    choice = response.choices[0]
    msg = choice.message
    calls = []
    for tc in getattr(msg, "tool_calls", None) or []:
        fn = tc.function
        calls.append(ToolCall(id=tc.id or "", name=fn.name or "", arguments=fn.arguments or "{}"))
    hidden = getattr(response, "_hidden_params", None) or {}
    blocks = getattr(msg, "thinking_blocks", None)
    return LlmTurn(
        text=msg.content if isinstance(msg.content, str) else None,
        reasoning=getattr(msg, "reasoning_content", None) or None,
        thinking_blocks=[dict(b) for b in blocks] if blocks else None,
        tool_calls=calls,
        usage=usage_of(getattr(response, "usage", None), hidden.get("response_cost")),
        model=str(getattr(response, "model", "") or ""),
        finish_reason=getattr(choice, "finish_reason", None),
        at=now,
        duration_ms=round(duration_ms, 3),
    )


def streamed_turn(litellm: Any, answer: Answer, duration_ms: float, now: float) -> LlmTurn:
    """The `LlmTurn` of a streamed answer: the same turn `to_llm_turn` makes of the same answer
    asked for whole (text, reasoning, tool calls in order, usage, cost, finish reason)."""
    calls = [
        ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments) or "{}") for _, c in sorted(answer.calls.items())
    ]
    blocks = answer.thinking_blocks(litellm)
    return LlmTurn(
        text="".join(answer.text) if answer.text else None,
        reasoning="".join(answer.reasoning) or None,
        thinking_blocks=[dict(b) for b in blocks] if blocks else None,
        tool_calls=calls,
        usage=usage_of(answer.usage, answer.cost),
        model=answer.model,
        finish_reason=answer.finish_reason,
        at=now,
        duration_ms=round(duration_ms, 3),
    )


def interrupted_usage(litellm: Any, model: str, messages: list[dict[str, Any]], answer: Answer | None) -> Usage:
    """What a cancelled call spent: the usage its stream reported, if it got that far; else
    estimated with litellm's token counter from the request and what arrived of the answer, priced
    where litellm knows the model (an unpriced model costs nothing known)."""
    if answer is not None and answer.usage is not None:
        return usage_of(answer.usage, answer.cost)
    partial = "".join(answer.text + answer.reasoning) if answer is not None else ""
    try:
        prompt = int(litellm.token_counter(model=model, messages=messages))
        completion = int(litellm.token_counter(model=model, text=partial)) if partial else 0
    except Exception:  # an estimate only: never let it fail the step
        prompt, completion = sum(len(str(m.get("content") or "")) for m in messages) // 4, len(partial) // 4
    cost: float | None = None
    with contextlib.suppress(Exception):
        cost = float(sum(litellm.cost_per_token(model=model, prompt_tokens=prompt, completion_tokens=completion)))
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return usage.model_copy(update={"cost": cost}) if cost is not None else usage


#: how much longer than its own timeout a model call may take before its wait gives up on it
WAIT_GRACE_S = 10.0

#: litellm's lists of callbacks that hear of a successful call; while all are empty nothing listens
_SUCCESS_LISTENERS = ("callbacks", "success_callback", "_async_success_callback", "input_callback")


def listened(litellm: Any) -> bool:
    """Whether some litellm callback hears of successful calls."""
    return any(getattr(litellm, name, None) for name in _SUCCESS_LISTENERS)


@contextlib.contextmanager
def unlogged_unless_heard(litellm: Any) -> Iterator[None]:
    """After every successful call litellm builds a record of it for its callbacks, on a background
    thread (sync calls) or a task (async ones): 0.35 ms of CPU per call of the demo model and
    0.65 ms per call of an OpenAI-compatible server, measured — a third and a sixth of the whole
    call — and, for a step, a thread that takes the GIL just as the step commits. With no callback
    configured nobody reads that record, so the call is marked as one litellm need not log (its
    internal-call flag, which skips exactly that: usage and cost are still set on the response).
    An operator who configures litellm callbacks in the worker gets every call logged as before."""
    if listened(litellm):
        yield
        return
    from litellm._internal_context import is_internal_call

    token = is_internal_call.set(True)
    try:
        yield
    finally:
        is_internal_call.reset(token)


def _call(litellm: Any, kwargs: dict[str, Any]) -> Any:
    with unlogged_unless_heard(litellm):
        return litellm.completion(**kwargs)


async def _acall(litellm: Any, kwargs: dict[str, Any]) -> Any:
    # Inside the coroutine: the loop's task runs in a context of its own, not the waiting thread's.
    with unlogged_unless_heard(litellm):
        return await litellm.acompletion(**kwargs)


async def _astream(litellm: Any, kwargs: dict[str, Any], answer: Answer, relay: Relay) -> Answer:
    """Ask for the answer as a stream and read it into `answer`, its pieces into `relay`."""
    with unlogged_unless_heard(litellm):
        response = await litellm.acompletion(stream=True, stream_options={"include_usage": True}, **kwargs)
        http = wire.readable(litellm, response, listened(litellm))
        if http is not None:  # read off the wire: litellm's per-chunk work skipped (llm/wire.py)
            await wire.fold(litellm, response, http, answer, relay)
            return answer
        async for chunk in response:
            answer.add(chunk, relay)
    answer.reported(getattr(response, "chunks", None))  # litellm's stream keeps the chunks it received
    return answer


def _write_offline(live: LiveOutput, model: str, turn: LlmTurn) -> None:
    """An offline model's answer: all of it arrives at once, so it is written as one batch, its
    reasoning then its text (llm/offline.py `live_parts`: the `test/tools` model's in pieces)."""
    parts = live_parts(model, turn.reasoning, turn.text)
    if parts:
        live.write(parts)


class LitellmPort:
    """The scheduler's `LlmPort` over `litellm.completion`."""

    def __init__(
        self,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        on_retry: Callable[[int, str, float], None] | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy.from_env()
        self._sleep = sleep
        self._on_retry = on_retry
        self.requests = 0

    def complete(self, request: LlmRequest) -> LlmTurn:
        """Call the agent's model, retrying transient failures; then each fallback model in turn."""
        agent = request.agent
        endpoints = [(agent.model, agent.api_base, agent.api_key_env)] + [
            (f.model, f.api_base, f.api_key_env) for f in agent.fallback_models
        ]
        failures: list[LlmFailure] = []
        for model, api_base, api_key_env in endpoints:
            try:
                with observe.model_call(model) as watch:
                    turn = self._complete_with(request, model, api_base, api_key_env)
                    observe.model_answered(watch, model, turn)
                return turn
            except LlmFailure as exc:
                failures.append(exc)
        last = failures[-1]
        if len(failures) == 1:
            raise last
        tried = "; ".join(f.message for f in failures)  # each names its model and endpoint
        # A model that said when to ask again (429 with Retry-After) is asked again then.
        told = next((f for f in failures if f.retry_after is not None), None)
        raise LlmFailure(
            told.code if told else last.code,
            f"every model failed — {tried}",
            transient=any(f.transient for f in failures),
            retry_after=told.retry_after if told else None,
            model=told.model if told else "",
        )

    def _complete_with(self, request: LlmRequest, model: str, api_base: str | None, api_key_env: str | None) -> LlmTurn:
        litellm = ensure_litellm()
        agent = request.agent
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": request.messages,
            "timeout": self.retry.timeout,
            "max_retries": 0,
            "num_retries": 0,
        }
        if request.tools:
            kwargs["tools"] = request.tools
        if api_base:
            kwargs["api_base"] = api_base
        # An offline model answers in this process and waits on nothing: it is called right here.
        # Every other model waits on the network, on the process's model loop (llm/loop.py).
        local = is_offline(model)
        if local:
            register_offline_model(litellm, model)
        key = _api_key(model, api_base, api_key_env, agent.slug)
        if key:
            kwargs["api_key"] = key
        kwargs.update(agent.model_params)
        if kwargs.get("organization") and _http_route():  # the header the SDK would send
            sent = {"OpenAI-Organization": kwargs["organization"]}
            kwargs["extra_headers"] = {**sent, **(kwargs.get("extra_headers") or {})}
        live = request.live
        attempt = 0
        while True:
            attempt += 1
            if live is not None and live.interrupted():
                raise LlmInterrupted(Usage(), model=model, called=False)
            started = time.monotonic()
            answer: Answer | None = None
            if live is not None:
                live.start()
            try:
                self.requests += 1
                if local:
                    turn = to_llm_turn(_call(litellm, kwargs), (time.monotonic() - started) * 1000, time.time())
                    if live is not None and agent.streams and live.watched:
                        _write_offline(live, model, turn)
                    return turn
                # litellm's own timeout ends the call; the wait has a bound of its own in case it
                # does not (the step would otherwise hold its lease for ever): streamed, while
                # nothing arrives for that long.
                bound = self.retry.timeout + WAIT_GRACE_S
                if live is None:
                    response = wait_on_loop(_acall(litellm, kwargs), timeout=bound)
                    return to_llm_turn(response, (time.monotonic() - started) * 1000, time.time())
                relay = Relay(live.max_chars, live.interval)
                if not (agent.streams and live.watched):  # whole, and still cancelled by an interrupt
                    response = await_answer(_acall(litellm, kwargs), live, relay, bound)
                    return to_llm_turn(response, (time.monotonic() - started) * 1000, time.time())
                answer = Answer()
                await_answer(_astream(litellm, kwargs, answer, relay), live, relay, bound)
                return streamed_turn(litellm, answer, (time.monotonic() - started) * 1000, time.time())
            except Interrupted:
                usage = interrupted_usage(litellm, model, request.messages, answer)
                raise LlmInterrupted(usage, model=model, chars=answer.chars if answer else 0) from None
            except LlmInterrupted:
                raise
            except LlmFailure:
                raise
            except Exception as exc:
                c = classify(exc)
                where = f"{model} at {api_base}" if api_base else model
                if c.code == "rate_limited" and c.retry_after is not None:
                    # The provider said when to ask again: this thread does not wait for it. The step
                    # goes back until then, and the model is paused for the whole fleet meanwhile
                    # (runtime/admission.py).
                    raise LlmFailure(
                        c.code, f"{where}: {c.message}", transient=True, retry_after=c.retry_after, model=model
                    ) from exc
                if not c.transient or attempt >= self.retry.attempts:
                    suffix = f" (after {attempt} attempts)" if c.transient else ""
                    raise LlmFailure(c.code, f"{where}: {c.message}{suffix}", transient=c.transient) from exc
                delay = self.retry.delay(attempt, c.retry_after)
                if self._on_retry:
                    self._on_retry(attempt, c.code, delay)
                self._sleep(delay)
