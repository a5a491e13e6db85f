"""On a Redis Cluster every script touches one hash slot. These tests check the key layout that
makes it so, without a cluster: for every session script and several `AGENTS_INDEX_SHARDS`, the
keys it gets (store/keys.py `named`) and the keys the store adds (the shard's agent spec, id index,
`expiring`, `rewound`, tokens, call leases, the sessions above it) share the session's slot; and,
running real flows on one Redis with 16 shards, every script call the store makes is single-slot.
With one shard the names are today's, exactly (no stored-format change on a single Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from celery_agents.config import Settings
from celery_agents.errors import UnknownSession
from celery_agents.model import UserQuery, child_session_id
from celery_agents.model.slots import SLOTS, id_in_slot, key_slot, shard_slots, shard_tags, tag_slot
from celery_agents.store import Store, client_for_url
from celery_agents.store.keys import Keys
from celery_agents.store.scripts import STANDALONE, key_names, script_names
from tests.chaos.invariants import check_invariants
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import AGENT, start, step

SESSION_SCRIPTS = [n for n in script_names() if n not in STANDALONE]
SHARD_COUNTS = [2, 3, 7, 16, 64, 256, 1024]


def slots_of(keys: list[str]) -> set[int]:
    return {key_slot(k) for k in keys}


def keys_beside(keys: Keys, sid: str) -> list[str]:
    """Every key the store passes a session script besides its named ones: the shard's spec and id
    index, `expiring`, `rewound`, a token, a call's lease and start marker, and the keys of the
    sessions above and below it (its parent, its child: budgets and claims span a tree)."""
    shard = keys.for_session(sid)
    child = child_session_id(sid, "1:0")
    grandchild = child_session_id(child, "2:1")
    return [
        shard.agent("h" * 64),
        shard.agent_signature("h" * 64),
        shard.ids,
        shard.expiring,
        shard.rewound,
        keys.token(sid, "secret-secret-secret"),
        keys.call_lease(sid, "1:0"),
        keys.call_started(sid, "1:0"),
        *keys.every_session_key(sid, ["1:0"], ["s" * 24]),
        keys.meta(child),
        keys.claims(child),
        keys.meta(grandchild),
        keys.claims(grandchild),
    ]


@pytest.mark.parametrize("shards", SHARD_COUNTS)
@pytest.mark.parametrize("name", SESSION_SCRIPTS)
def test_every_key_of_a_session_script_is_in_the_sessions_slot(name: str, shards: int) -> None:
    keys = Keys("agents", shards)
    for _ in range(5):
        sid = keys.new_session_id()
        named = keys.named(key_names(name), sid, "request-1")
        assert slots_of(named + keys_beside(keys, sid)) == {tag_slot(sid)}, (name, shards, sid)


@pytest.mark.parametrize("shards", SHARD_COUNTS)
def test_each_shard_has_its_own_slot_and_every_new_id_lands_in_one(shards: int) -> None:
    keys = Keys("agents", shards)
    slots = shard_slots(shards)
    assert len(set(slots)) == shards and all(0 <= s < SLOTS for s in slots)
    for n, shard in enumerate(keys.all_shards()):
        assert shard.shard == n
        assert slots_of([*shard.global_keys(), shard.completions, shard.rejected, shard.ids]) == {slots[n]}
    seen = {keys.shard_of(keys.new_session_id()) for _ in range(40 * shards)}
    assert len(seen) > shards // 2, "new sessions spread over the shards"


def test_a_fork_lands_beside_its_origin_and_a_child_in_its_parents_slot() -> None:
    keys = Keys("agents", 16)
    origin = keys.new_session_id()
    fork = keys.new_session_id(beside=origin)
    assert fork != origin and tag_slot(fork) == tag_slot(origin)
    assert keys.shard_of(fork) == keys.shard_of(origin)
    child = child_session_id(origin, "3:1")
    assert child == child_session_id(origin, "3:1"), "derived: every attempt names the same child"
    assert tag_slot(child) == tag_slot(origin) and len(child) == 32


def test_an_id_made_elsewhere_is_refused_on_shards_and_taken_on_one() -> None:
    stray = "0" * 32
    assert Keys("agents", 1).shard_of(stray) == 0
    off = next(s for s in ("a", "b", "c", "d") if tag_slot(s * 32) not in shard_slots(16)) * 32
    with pytest.raises(UnknownSession, match="no index shard"):
        Keys("agents", 16).shard_of(off)
    assert not Keys("agents", 16).owns(off) and Keys("agents", 1).owns(off)


def test_id_in_slot_reaches_every_slot() -> None:
    for slot in range(0, SLOTS, 97):
        assert tag_slot(id_in_slot("x" * 27, slot)) == slot


def test_with_one_shard_every_name_is_as_before() -> None:
    k = Keys("agents")
    assert k.at(0) is k and k.all_shards() == (k,)
    assert (k.pending_all, k.deadlines, k.owed, k.expiring, k.dispatched, k.counters, k.ids) == (
        "agents:pending",
        "agents:deadlines",
        "agents:owed",
        "agents:expiring",
        "agents:dispatched",
        "agents:counters",
        "agents:ids",
    )
    assert k.state_index("ready") == "agents:state:ready"
    assert (k.completions, k.rejected, k.rewound) == (
        "agents:completions",
        "agents:completions:rejected",
        "agents:rewound",
    )
    assert (k.agent("h"), k.agent_signature("h")) == ("agents:agent:h", "agents:agent:h:sig")
    assert k.for_session("any-id") is k


def test_sharded_names_carry_the_shards_tag() -> None:
    k = Keys("agents", 16)
    tag = shard_tags(16)[3]
    assert k.at(3).owed == f"agents:{{{tag}}}:owed"
    assert k.at(3).completions == f"agents:{{{tag}}}:completions"
    assert k.workers == "agents:workers" and k.format == "agents:format", "fleet keys are not sharded"


@pytest.fixture
def sharded(redis_url: str, prefix: str) -> Iterator[Store]:
    """A store on one Redis with 16 index shards, whose every script call is checked for one slot."""
    store = Store(client_for_url(redis_url), Settings(redis_url=redis_url, prefix=prefix, index_shards=16))
    scripts = store.scripts
    run = scripts.run
    calls: list[tuple[str, list[str]]] = []

    def checked(name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        calls.append((name, keys))
        assert len(slots_of(keys)) <= 1, f"{name} touches slots {slots_of(keys)}: {keys}"
        return run(name, keys, args, client)

    scripts.run = checked  # type: ignore[method-assign]
    store.checked_calls = calls  # type: ignore[attr-defined]
    yield store


def test_flows_on_sixteen_shards_send_single_slot_scripts_only(sharded: Store) -> None:
    store = sharded
    sid = start(store)
    step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    step(store, sid)
    step(store, sid, ScriptedLlm(llm_turn(text="done")))
    check_invariants(store, sid)
    assert [s.session_id for s in store.list_sessions()] == [sid]
    assert store.state_counts()["completed"] == 1
    assert store.resolve(sid[:8]) == sid

    other = start(store, drive="auto", owe=True)
    store.send_message(other, UserQuery(text="and also"))
    assert store.owed(older_than=store.server_time() + 1) == [other]
    store.sweep_owed([(other, False)], store.server_time())
    store.cancel(other)
    fork = store.fork_session(store.origin_at(sid, 2))
    assert tag_slot(fork.header.session_id) == tag_slot(sid)
    assert store.agent(AGENT.content_hash(), fork.header.session_id) == AGENT
    assert store.delete_session(other) > 0
    names = {name for name, _ in store.checked_calls}  # type: ignore[attr-defined]
    assert {"create_session", "begin_step", "commit_step", "fork_session", "delete_session", "sweep_owed"} <= names
