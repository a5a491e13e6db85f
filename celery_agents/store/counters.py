"""The fleet's counters: one Redis hash (`Keys.counters`), a field per series and label values
(`<series>\\x1f<label>\\x1f...`), added to by the script that records the work it counts: a step's
commit counts the step, its model calls and tokens and its inline tool calls; a call's recorded
result, a token's completion or expiry and the sweeper's republish count theirs. A script that
counts several things pushes them as one entry to a short list (`Keys.tally`), which the write
that brings it to 64 entries adds to the hash. A count is then true whichever process did the
work (a worker, the CLI running steps inline, `agents serve` applying a completion), and every
`/metrics` reads the hash and the list of each index shard at one moment and serves the same
fleet totals. Counts travel to a script as `counts_json`; a few paths that end with no script of
their own add theirs with `CounterStore.count` (one round trip)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import cast

import redis

from celery_agents.store.core import StoreCore
from celery_agents.store.keys import Keys

log = logging.getLogger("celery_agents.store")

#: a counter's series and label values, e.g. ("tool_calls", "lookup", "runSync", "completed")
CounterKey = tuple[str, ...]
Counts = Mapping[CounterKey, int]

#: between the parts of a field (a label value never holds it: `counter_field` replaces it)
SEP = "\x1f"


def counter_field(key: CounterKey) -> str:
    """The hash field of one counter (Lua builds the same with `count` in `_lib.lua`)."""
    return SEP.join(part.replace(SEP, " ") for part in key)


def counts_json(counts: Counts) -> str:
    """Counts as a script takes them (`add_counts` in `_lib.lua`): `[[field, n], ...]`."""
    return json.dumps([[counter_field(k), n] for k, n in counts.items() if n], ensure_ascii=False)


#: a shard's hash and list read at once (a script runs whole), for a store of several shards
_READ_SHARD = "return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}"


def read_counters(client: redis.Redis, keys: Keys) -> dict[CounterKey, float]:
    """Every counter of the fleet, read at once (counts are whole; the spend in USD is not): the
    hash, plus what its `tally` list holds (a step's commit adds its counts there in one command;
    `_lib.lua` `add_counts`), both read at one moment, since the write that fills the list moves
    its entries to the hash. Each index shard counts the work of its sessions: the fleet's count
    is their sum, each shard read by a script of its own, all in one pipeline (on a Cluster, one
    round trip per primary)."""
    shards = keys.all_shards()
    if len(shards) == 1:
        pipe = client.pipeline(transaction=True)
        pipe.hgetall(keys.counters)
        pipe.lrange(keys.tally, 0, -1)
        read = [cast("tuple[dict[str, str], list[str]]", tuple(pipe.execute()))]
    else:
        pipe = client.pipeline(transaction=False)
        for shard in shards:
            pipe.execute_command("EVAL", _READ_SHARD, 2, shard.counters, shard.tally)  # type: ignore[no-untyped-call]
        read = [(dict(zip(flat[::2], flat[1::2], strict=True)), tally) for flat, tally in pipe.execute()]
    out: dict[CounterKey, float] = {}
    for raw, tally in read:
        for field, value in raw.items():
            _add(out, field, _number(value))
        for entry in tally:
            for field, n in _tally_entry(entry):
                _add(out, field, n)
    return out


def _add(out: dict[CounterKey, float], field: str, n: float) -> None:
    key = tuple(field.split(SEP))
    out[key] = out.get(key, 0) + n


def _tally_entry(entry: str) -> list[tuple[str, int]]:
    """The pairs of one entry of a `tally` list, `[[field, n], ...]`, that count: a field and a
    whole number, as `_lib.lua` `fold_tally` adds them (nobody but this store's scripts writes
    there; anything else counts nothing, on both sides)."""
    try:
        pairs = json.loads(entry)
    except ValueError:
        log.warning("ignored an entry of the counters' tally that is not JSON: %.80r", entry)
        return []
    if not isinstance(pairs, list):
        return []
    return [
        (p[0], int(p[1]))
        for p in pairs
        if isinstance(p, list)
        and len(p) >= 2
        and isinstance(p[0], str)
        and isinstance(p[1], (int, float))
        and not isinstance(p[1], bool)
        and math.isfinite(p[1])
        and p[1] == int(p[1])
    ]


def _number(text: str) -> float:
    try:
        return int(text)
    except ValueError:
        return float(text)


class CounterStore(StoreCore):
    """Adding to the fleet's counters where no script records the work."""

    def count(self, counts: Counts) -> None:
        """Add `counts` now, in one round trip: for work that ends with no script of its own (a
        step that lost its lease). A count is not worth failing the work for: a Redis error is
        logged, not raised."""
        if not counts:
            return
        pipe = self.client.pipeline(transaction=True)
        for key, n in counts.items():
            pipe.hincrby(self.keys.counters, counter_field(key), n)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("counts not added (%s): %s", exc, dict(counts))

    def counters(self) -> dict[CounterKey, float]:
        return read_counters(self.client, self.keys)
