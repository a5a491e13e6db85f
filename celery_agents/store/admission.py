"""The fleet's limits on model calls in Redis: setting them, admitting a call under them
(`lua/admit.lua`, one round trip), ending it (`lua/release.lua`, sent with the step's commit),
pausing a model after a provider's 429, and what doctor and `/metrics` show of them.

Every key is under the `{limits}` hash tag (`Keys.limits` and the ones after it), so one script
reaches every limit a call is under. Whether any limit applies to a call is decided on this
process's copy of the limits and pauses, read at most every `AGENTS_LIMITS_REFRESH` seconds (one
round trip): a step of an agent under no limit pays nothing; a limit set or deleted applies
everywhere within that time; a pause applies at once where it was seen, elsewhere within it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from celery_agents.model import AgentSpec
from celery_agents.model.admission import LimitUsage, ModelLimit, Pause, check_limit_key
from celery_agents.store.core import StoreCore
from celery_agents.store.records import Released, Waiter

#: why a call was not admitted now (admit.lua's reply; "budget": a claim on a budget above the
#: session had to wait for its siblings' calls in flight, store/budget.py)
WaitReason = Literal["rate", "concurrency", "paused", "budget"]


@dataclass(frozen=True)
class Admission:
    """What admit.lua said: admitted, or `until` (seconds, Redis's clock) when to come back and
    why; `now` is Redis's clock when it decided."""

    admitted: bool
    now: float
    until: float = 0.0
    reason: WaitReason | None = None
    key: str = ""
    #: admitted: release.lua has something to do once the call ends (a slot, tokens to correct)
    release: bool = False


@dataclass
class HeldCall:
    """A model call admitted under the limits of `keys`: its slot, its estimate, and (once it
    answered) the tokens to add to the estimate."""

    model: str
    keys: tuple[str, ...]
    slot: str
    estimate: int
    #: the KEYs among `keys` with a concurrency limit: their slots are renewed while the call lasts
    slotted: tuple[str, ...] = ()
    delta: int = 0
    #: a provider's 429 with Retry-After: (model, seconds) to pause it for the whole fleet
    pause: tuple[str, float] | None = None
    #: release.lua has something to do once the call ends (admit.lua said so), or a pause to record
    needs_release: bool = True


@dataclass(frozen=True)
class FleetLimits:
    """This process's copy of the limits and pauses, with Redis's clock when it was read."""

    limits: dict[str, ModelLimit] = field(default_factory=dict)
    #: model -> until when it is paused (ms, Redis's clock)
    paused: dict[str, float] = field(default_factory=dict)
    redis_ms: float = 0.0
    read_at: float = -1e18

    def keys_for(self, agent: AgentSpec) -> tuple[str, ...]:
        """The KEYs whose limits a call of `agent` is under: its model's, its `limitKey`'s."""
        return tuple(k for k in dict.fromkeys((agent.model, agent.limit_key)) if k and k in self.limits)

    def paused_now(self, model: str) -> bool:
        """Whether `model` is paused now, by Redis's clock as read then and moved on by this
        process's monotonic clock."""
        until = self.paused.get(model)
        return until is not None and until > self.redis_ms + (time.monotonic() - self.read_at) * 1000

    def wants_tokens(self, keys: Iterable[str]) -> bool:
        return any(self.limits[k].tpm is not None for k in keys)


class LimitStore(StoreCore):
    """Fleet limits: set, listed, admitted under, released."""

    _fleet_limits: FleetLimits = FleetLimits()

    # -- what applies -------------------------------------------------------------------------
    def fleet_limits(self) -> FleetLimits:
        """The limits and pauses, as read at most `limits_refresh` seconds ago. One thread of the
        process reads them again while the others wait for it (a copy older than that must not
        decide: a limit just set would be missed), rather than all sending the same read."""
        seen = self._fleet_limits
        if time.monotonic() - seen.read_at < self.settings.limits_refresh:
            return seen
        with self._fleet_refresh:
            if self._fleet_limits is seen:
                self._fleet_limits = self._read_fleet_limits()
            return self._fleet_limits

    def _read_fleet_limits(self) -> FleetLimits:
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(k.limits)
        pipe.hgetall(k.limits_paused)
        (sec, usec), raw, paused = self.through_outage(pipe.execute)
        return FleetLimits(
            limits={key: ModelLimit.model_validate_json(v) for key, v in raw.items()},
            paused={m: float(v) for m, v in paused.items()},
            redis_ms=sec * 1000 + usec / 1000,
            read_at=time.monotonic(),
        )

    def _forget_fleet_limits(self) -> None:
        """Read the limits again at the next call (this process changed them)."""
        self._fleet_limits = FleetLimits()

    # -- set, list, delete --------------------------------------------------------------------
    def set_limit(self, key: str, limit: ModelLimit) -> None:
        """KEY's limits become `limit` (a kind it leaves out is not limited)."""
        self.client.hset(self.keys.limits, check_limit_key(key), limit.to_json())
        self._forget_fleet_limits()

    def delete_limit(self, key: str) -> tuple[bool, list[Waiter]]:
        """Remove KEY's limits and its state; returns whether it had any, and the steps that were
        waiting for one of its slots (to wake now: nothing else will)."""
        k = self.keys
        check_limit_key(key)
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(k.limits, key)
        pipe.zrange(k.limit_waiters(key), 0, -1)
        pipe.delete(k.limit_state(key), k.limit_in_flight(key), k.limit_waiters(key))
        removed, waiting, _ = pipe.execute()
        self._forget_fleet_limits()
        return bool(removed), [Waiter.from_member(m) for m in waiting]

    def limit_usages(self, keys: Sequence[str] | None = None) -> list[LimitUsage]:
        """Every limit (or those of `keys`) with what the fleet does under it now: one round trip."""
        k = self.keys
        raw = cast("dict[str, str]", self.client.hgetall(k.limits))
        names = sorted(raw) if keys is None else [n for n in keys if n in raw]
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        for name in names:
            pipe.hgetall(k.limit_state(name))
            pipe.zcard(k.limit_in_flight(name))
            pipe.zcard(k.limit_waiters(name))
        rows = pipe.execute()
        sec, usec = rows[0]
        now_ms = sec * 1000 + usec / 1000
        out = []
        for i, name in enumerate(names):
            state, in_flight, waiting = rows[1 + 3 * i : 4 + 3 * i]
            limit = ModelLimit.model_validate_json(raw[name])
            out.append(_usage(name, limit, state, in_flight, waiting, now_ms, self.settings.limits_burst * 1000))
        return out

    def pauses(self) -> list[Pause]:
        """The models paused now by a provider's 429 (their pause not over by Redis's clock)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(self.keys.limits_paused)
        (sec, usec), raw = pipe.execute()
        now_ms = sec * 1000 + usec / 1000
        return [Pause(m, float(v) / 1000) for m, v in sorted(raw.items()) if float(v) > now_ms]

    # -- one call -----------------------------------------------------------------------------
    def admit(
        self, model: str, keys: Sequence[str], estimate: int, slot: str, waiter: Waiter, *, returning: bool = True
    ) -> Admission:
        """Admit one model call (`slot` names it) under the limits of `keys` and `model`'s pause,
        or book when it may start (admit.lua). `returning`: the step was put back before (else it
        holds no booking, and none is looked for)."""
        k = self.keys
        lease_ms = int(self.settings.lease_seconds * 1000)
        burst_ms = self.settings.limits_burst * 1000
        argv = [model, estimate, slot, lease_ms, waiter.member, waiter.priority, burst_ms, int(returning), *keys]
        res = self.through_outage(
            lambda: self.scripts.run(
                "admit", self._limit_keys(keys, k.limit_booking(waiter.session_id, waiter.version)), argv
            )
        )
        if res[0] == "ok":
            return Admission(True, now=float(res[1]) / 1000, release=bool(res[2]))
        return Admission(False, now=float(res[4]) / 1000, until=float(res[1]) / 1000, reason=res[2], key=res[3])

    def release_args(self, held: HeldCall) -> tuple[list[str], list[Any]]:
        """release.lua's keys and arguments for `held` (sent alone, or with the step's commit)."""
        model, seconds = held.pause if held.pause is not None else ("", 0.0)
        keys = self._limit_keys(held.keys)
        return keys, [held.slot, held.delta, model, int(seconds * 1000), *held.keys]

    def release(self, held: HeldCall) -> Released:
        """End `held` now, in one round trip (a step that commits sends it with its commit)."""
        keys, argv = self.release_args(held)
        return self.released(self.through_outage(lambda: self.scripts.run("release", keys, argv)))

    def released(self, reply: list[Any]) -> Released:
        """release.lua's reply as what it did; a pause recorded here applies here at once."""
        until = float(reply[0]) / 1000 if reply[0] else None
        if until is not None:
            self._forget_fleet_limits()
        return Released(float(reply[1]) / 1000, until, tuple(Waiter.from_member(m) for m in reply[2:]))

    def pause_model(self, model: str, seconds: float) -> float:
        """Pause `model` for the whole fleet for `seconds` (a provider's 429 with Retry-After),
        unless it is paused longer already; returns until when (seconds, Redis's clock)."""
        paused = self.release(HeldCall(model=model, keys=(), slot="", estimate=0, pause=(model, seconds)))
        assert paused.paused_until is not None
        return paused.paused_until

    def slot_key(self, key: str) -> str:
        return self.keys.limit_in_flight(key)

    def _limit_keys(self, keys: Sequence[str], *between: str) -> list[str]:
        k = self.keys
        per_key = [x for key in keys for x in (k.limit_state(key), k.limit_in_flight(key), k.limit_waiters(key))]
        return [k.limits, k.limits_paused, *between, *per_key]


def _usage(
    name: str, limit: ModelLimit, state: dict[str, str], in_flight: int, waiting: int, now_ms: float, burst_ms: float
) -> LimitUsage:
    def number(field_name: str) -> float:
        return float(state.get(field_name) or 0)

    minute = int(now_ms // 60000)
    stored = int(number("minute")) if state.get("minute") else -2
    this = (number("req"), number("tok")) if stored == minute else (0.0, 0.0)
    if stored == minute:
        last = (number("req_prev"), number("tok_prev"))
    elif stored == minute - 1:
        last = (number("req"), number("tok"))
    else:
        last = (0.0, 0.0)
    # When a call of one request asking now could start by each rate (admit.lua's t*); a token
    # rate is judged for a call of a second's worth of tokens.
    booked = 0.0
    if limit.rpm:
        per = 60000 / limit.rpm
        booked = max(booked, number("req_tat") + per - max(burst_ms, per) - now_ms)
    if limit.tpm:
        booked = max(booked, number("tok_tat") - now_ms)
    return LimitUsage(
        key=name,
        limit=limit,
        requests_this_minute=int(this[0]),
        tokens_this_minute=int(this[1]),
        requests_last_minute=int(last[0]),
        tokens_last_minute=int(last[1]),
        in_flight=int(in_flight),
        waiting=int(waiting),
        booked_seconds=max(0.0, booked / 1000),
    )
