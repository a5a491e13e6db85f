"""Every Redis key celery-agents uses, named here and nowhere else.

Session keys carry the hash tag `{<session_id>}` so that one session's keys share a Cluster slot.
A session script receives in `KEYS` the keys it touches, in the order of `SCRIPT_KEY_NAMES`.

The global indexes (states, pending, deadlines, owed, dispatched, expiring, counters,
ids, the completions streams, rewound, agent specs) are split into `shards` (AGENTS_INDEX_SHARDS):
with one shard their names are `<prefix>:<name>`; with more, shard n's are
`<prefix>:{<tag n>}:<name>`, every key of a shard in one slot (model/slots.py), and a session's
entries go to the shard its id's slot picks. `Keys.at(n)` names shard n's keys, `for_session(sid)`
the shard of a session, `all_shards()` each one; a plain `Keys` names shard 0's.
"""

from __future__ import annotations

import secrets
import uuid
from functools import cached_property

from celery_agents.errors import UnknownSession
from celery_agents.model import State
from celery_agents.model.slots import id_in_slot, shard_slots, shard_tags, slot_shards, tag_slot

SESSION_KEY_NAMES = (
    "meta",
    "turns",
    "calls",
    "results",
    "pending",
    "journal",
    "events",
    "packed",
    "lease",
    "inbox",
    "children",
    "versions",
    "replay",
    "claims",
)
#: the shared keys a session script gets after the session's (then one index per stored state)
SHARED_KEY_NAMES = ("pending_all", "deadlines", "owed", "dispatched", "counters", "tally")
#: the states a session is stored in, each with its index (`running` is only ever shown)
STORED_STATES = tuple(s.value for s in State if s is not State.RUNNING)
#: the states of a session that no longer runs: the ones `delete` and `purge` take
FINISHED_STATES = (State.COMPLETED.value, State.FAILED.value, State.CANCELLED.value)
#: every key a session script may touch, by name, in the order a script gets those it touches
#: (store/scripts.py `key_names` finds them in its source: `K.<name>`, `STATE_KEYS`)
SCRIPT_KEY_NAMES = (
    *SESSION_KEY_NAMES,
    *SHARED_KEY_NAMES,
    *(f"state:{s}" for s in STORED_STATES),
    "request",
)


class Keys:
    """Key builder for one prefix (default `agents`) and its index shards; names shard `shard`'s
    index keys."""

    def __init__(self, prefix: str = "agents", shards: int = 1, shard: int = 0) -> None:
        if shards < 1 or not 0 <= shard < shards:
            raise ValueError(f"shard {shard} of {shards}")
        self.prefix = prefix
        self.shards = shards
        self.shard = shard
        #: what every index key of this shard starts with
        self.base = prefix if shards == 1 else f"{prefix}:{{{shard_tags(shards)[shard]}}}"

    # -- shards -------------------------------------------------------------------------------
    @cached_property
    def _views(self) -> tuple[Keys, ...]:
        if self.shards == 1:
            return (self,)
        return tuple(self if n == self.shard else Keys(self.prefix, self.shards, n) for n in range(self.shards))

    def at(self, shard: int) -> Keys:
        """The keys of index shard `shard`."""
        return self._views[shard]

    def all_shards(self) -> tuple[Keys, ...]:
        """The keys of every index shard, shard 0 first."""
        return self._views

    def shard_of(self, sid: str) -> int:
        """The index shard of session `sid` (always 0 with one shard). With more, an id outside
        every shard's slot (one not made by `new_session_id`) names no session: `UnknownSession`."""
        if self.shards == 1:
            return 0
        shard = slot_shards(self.shards).get(tag_slot(sid))
        if shard is None:
            raise UnknownSession(
                f"unknown session {sid[:80]!r}: its id is in no index shard's hash slot "
                f"(AGENTS_INDEX_SHARDS={self.shards}; on a Redis Cluster, celery-agents makes session ids)",
                session_id=sid,
            )
        return shard

    def owns(self, sid: str) -> bool:
        """Session `sid` may exist here: always with one shard; with more, when its id is in a
        shard's slot."""
        return self.shards == 1 or tag_slot(sid) in slot_shards(self.shards)

    def for_session(self, sid: str) -> Keys:
        """The keys of the index shard of session `sid`."""
        return self._views[self.shard_of(sid)]

    def new_session_id(self, beside: str | None = None) -> str:
        """A new session id: random; with more than one shard, in the slot of a random shard, or
        (`beside`) in the slot of session `beside` (a fork beside its origin)."""
        if self.shards == 1 and beside is None:
            return uuid.uuid4().hex
        base = uuid.uuid4().hex[:27]
        if beside is not None:
            return id_in_slot(base, tag_slot(beside))
        return id_in_slot(base, shard_slots(self.shards)[secrets.randbelow(self.shards)])

    # -- one session --------------------------------------------------------------------------
    def session(self, sid: str, name: str) -> str:
        return f"{self.prefix}:s:{{{sid}}}:{name}"

    def meta(self, sid: str) -> str:
        """Hash: the session header."""
        return self.session(sid, "meta")

    def turns(self, sid: str) -> str:
        """List: stored turns (JSON), oldest first, append-only."""
        return self.session(sid, "turns")

    def calls(self, sid: str) -> str:
        """Hash `<batch>:<position>` -> tracked call (JSON) as created by its step."""
        return self.session(sid, "calls")

    def results(self, sid: str) -> str:
        """Hash `<batch>:<position>` -> the final outcome of an asynchronous call; first writer wins."""
        return self.session(sid, "results")

    def pending(self, sid: str) -> str:
        """Hash of the fields of the calls still unfinished (each to an empty value: a hash of
        short fields is a listpack, a set of them a hashtable)."""
        return self.session(sid, "pending")

    def journal(self, sid: str) -> str:
        """Hash of work done by the step in flight (LLM response, inline tool results)."""
        return self.session(sid, "journal")

    def events(self, sid: str) -> str:
        """Stream of the session's events, capped."""
        return self.session(sid, "events")

    def packed(self, sid: str) -> str:
        """String: the events of a session left waiting, packed (store/lua/_lib.lua `pack_events`:
        a stream costs ~600 bytes before its first entry); its next event puts them back in the
        stream. Lines: `1 <last id>`, then id, type, version, data of each event."""
        return self.session(sid, "packed")

    def lease(self, sid: str) -> str:
        """String: the worker running a step of the session, with a time to live."""
        return self.session(sid, "lease")

    def inbox(self, sid: str) -> str:
        """List: user messages sent while the session could not take them (`session send`), oldest
        first; the step that next calls the model delivers them and removes them in its commit."""
        return self.session(sid, "inbox")

    def children(self, sid: str) -> str:
        """Set: ids of the child sessions its sub-agent calls started."""
        return self.session(sid, "children")

    def versions(self, sid: str) -> str:
        """Hash: version -> what the session was at it (`store/history.py` `VersionEntry`: turns,
        head, state, the kind of write that made it, when), one field per version, written by the
        script that makes the version; the transcript at a version is a prefix of the turns."""
        return self.session(sid, "versions")

    def replay(self, sid: str) -> str:
        """Hash, rerun sessions only: call digest (tool and arguments) -> the outcome its origin
        recorded after the version the rerun started from; a call with that digest reuses it."""
        return self.session(sid, "replay")

    def claims(self, sid: str) -> str:
        """Hash, sessions with a budget only: member ("<session> <version> <owner>") -> the claim a
        step of a session below holds on this budget while its model or tool calls are in flight
        ("expires_ms model_calls tool_calls tokens cost", store/budget.py)."""
        return self.session(sid, "claims")

    def call_lease(self, sid: str, field: str) -> str:
        """String: the worker running a dispatched call, with a time to live."""
        return self.session(sid, f"call-lease:{field}")

    def call_started(self, sid: str, field: str) -> str:
        """String: a worker began running this dispatched call (kept a day)."""
        return self.session(sid, f"call-started:{field}")

    def token(self, sid: str, secret: str) -> str:
        """Hash: one continuation token."""
        return self.session(sid, f"tok:{secret}")

    def request(self, sid: str, request_id: str) -> str:
        """String, kept minutes: the reply of a script call (`store/lua/_lib.lua` `once`), so that a
        call retried after its reply was lost gets the first outcome instead of running again."""
        return self.session(sid, f"req:{request_id}")

    def session_keys(self, sid: str) -> list[str]:
        return [self.session(sid, n) for n in SESSION_KEY_NAMES]

    def every_session_key(self, sid: str, fields: list[str], secrets: list[str]) -> list[str]:
        """Every key a session may own, given its call fields and its tokens' secrets: what
        deleting it removes. A key added per session above belongs here too, except the script
        replies kept for retries (`request`), which expire by themselves within minutes."""
        per_call = [k for f in fields for k in (self.call_lease(sid, f), self.call_started(sid, f))]
        return [*self.session_keys(sid), *per_call, *(self.token(sid, s) for s in secrets)]

    # -- shared -------------------------------------------------------------------------------
    @property
    def format(self) -> str:
        """String: the stored format of everything under this prefix (store/core.py `STORED_FORMAT`)."""
        return f"{self.prefix}:format"

    @property
    def old_sessions_index(self) -> str:
        """Sorted set that earlier releases of format 3 kept of every session, by last update;
        nothing reads it now (each session is in its state's index), `check_format` drops it."""
        return f"{self.base}:sessions"

    def state_index(self, state: str) -> str:
        """Sorted set: session ids in one stored state, by last update (ms)."""
        return f"{self.base}:state:{state}"

    @property
    def pending_all(self) -> str:
        """Sorted set: `<session_id> <field>` of every unfinished call, by creation (ms)."""
        return f"{self.base}:pending"

    @property
    def deadlines(self) -> str:
        """Sorted set: `<session_id> <field>` of deferred calls, by deadline (ms)."""
        return f"{self.base}:deadlines"

    @property
    def owed(self) -> str:
        """Sorted set: sessions owed a step (the outbox), by when it became owed (ms)."""
        return f"{self.base}:owed"

    @property
    def expiring(self) -> str:
        """Sorted set: `<session_id> <field>` of deferred calls, by when `call_expiring` is due (ms):
        a tenth of the wait before the deadline, at most an hour before it."""
        return f"{self.base}:expiring"

    @property
    def dispatched(self) -> str:
        """Sorted set: `<session_id> <field>` of runAsync/runIsolated calls not finished, by when
        they were last dispatched or seen running (ms)."""
        return f"{self.base}:dispatched"

    @property
    def counters(self) -> str:
        """Hash: the fleet's counters, `<series>\\x1f<label>...` -> count (store/counters.py), each
        added to by the script that records the work it counts, directly or through `tally`; every
        `/metrics` reads it whole, with `tally`."""
        return f"{self.base}:counters"

    @property
    def tally(self) -> str:
        """List: counts not yet added to `counters`, each `[[field, n], ...]` (JSON) of one script
        that counted several (a step's commit); the write that fills it to 64 adds them there."""
        return f"{self.base}:tally"

    @property
    def ids(self) -> str:
        """Sorted set, every score 0: session ids in lexicographic order, so that a prefix of an
        id is found with ZRANGEBYLEX (no scan). Kept by create_session, cleaned by delete_session."""
        return f"{self.base}:ids"

    def global_keys(self) -> list[str]:
        shared: list[str] = [getattr(self, name) for name in SHARED_KEY_NAMES]
        return shared + [self.state_index(s) for s in STORED_STATES]

    def named(self, names: tuple[str, ...], sid: str, request_id: str) -> list[str]:
        """The keys of `SCRIPT_KEY_NAMES` called `names`, for session `sid` and the call
        `request_id` (a script's KEYS: store/scripts.py `key_names`)."""
        shard = self.for_session(sid)
        out = []
        for name in names:
            if name in SESSION_KEY_NAMES:
                out.append(self.session(sid, name))
            elif name.startswith("state:"):
                out.append(shard.state_index(name[len("state:") :]))
            elif name == "request":
                out.append(self.request(sid, request_id))
            else:
                out.append(getattr(shard, name))
        return out

    def agent(self, content_hash: str) -> str:
        """String: an agent spec (canonical JSON), stored once per content hash."""
        return f"{self.base}:agent:{content_hash}"

    def agent_signature(self, content_hash: str) -> str:
        """String: the HMAC-SHA256 of the spec under `agent(content_hash)` (AGENTS_SPEC_KEY)."""
        return f"{self.base}:agent:{content_hash}:sig"

    @property
    def completions(self) -> str:
        """Stream other systems XADD completions to (`token`, `result`, `error`, `by`)."""
        return f"{self.base}:completions"

    @property
    def interrupts(self) -> str:
        """Pub/sub channel (not a key): `<session id> <version> <queued>` for each message sent with
        `--interrupt` (send_message.lua); every process running steps listens (store/live.py)."""
        return f"{self.prefix}:interrupts"

    @property
    def rejected(self) -> str:
        """Stream: completions that changed nothing, with the reason."""
        return f"{self.base}:completions:rejected"

    @property
    def rewound(self) -> str:
        """Hash: session id -> what a worker saw when it found the stored session older than
        what it had read before (Redis lost writes); shown by `agents doctor`."""
        return f"{self.base}:rewound"

    @property
    def acks_fsynced(self) -> str:
        """String: a counter `start`, `send` and `complete` increment right before WAITAOF
        (`AGENTS_ACK_FSYNC=1`), on the connection that waits (store/durability.py)."""
        return f"{self.prefix}:acks:fsynced"

    @property
    def workers(self) -> str:
        """Hash: worker name -> heartbeat JSON."""
        return f"{self.prefix}:workers"

    def fault(self, name: str) -> str:
        """String: set by a worker paused at a fault-injection checkpoint (tests only)."""
        return f"{self.prefix}:fault:{name}"

    def lock(self, name: str) -> str:
        return f"{self.prefix}:lock:{name}"

    # -- fleet limits on model calls: one hash tag, so that an admission's keys share a slot ----
    def _limits(self, name: str) -> str:
        return f"{self.prefix}:{{limits}}:{name}"

    @property
    def limits(self) -> str:
        """Hash: limit KEY (a model name or a `limitKey`) -> its limits (JSON `ModelLimit`)."""
        return self._limits("config")

    @property
    def limits_paused(self) -> str:
        """Hash: model name -> until when (ms, Redis's clock) a provider's 429 with Retry-After
        paused it for the whole fleet; a past entry is dropped by the next admission that reads it."""
        return self._limits("paused")

    def limit_state(self, key: str) -> str:
        """Hash of one KEY: the rate limits' theoretical arrival times (`req_tat`, `tok_tat`, ms:
        GCRA, store/lua/admit.lua) and the requests and tokens of this minute and the one before."""
        return self._limits(f"state:{key}")

    def limit_in_flight(self, key: str) -> str:
        """Sorted set of one KEY with a concurrency limit: the slots of calls in flight, scored by
        when they lapse (ms, Redis's clock) unless their holder renews them."""
        return self._limits(f"inflight:{key}")

    def limit_waiters(self, key: str) -> str:
        """Sorted set of one KEY with a concurrency limit: `<session_id> <version> <priority>` of
        steps waiting for a slot, highest priority first, then oldest; a released slot wakes one."""
        return self._limits(f"waiters:{key}")

    def limit_booking(self, sid: str, version: int) -> str:
        """String, expiring: the rate-limit slot booked for the model call of the step of `sid` at
        `version` (JSON: when, under which KEYs), so that when it comes back it starts then."""
        return self._limits(f"booked:{sid}:{version}")

    @property
    def poison(self) -> str:
        """List: queue messages no worker could read, set aside with their queue and the reason
        (JSON, newest first, capped); written by `tasks/broker.py` through the broker's prefix."""
        return f"{self.celery_prefix}poison"

    @property
    def celery_prefix(self) -> str:
        """Prefix of the Celery broker's own keys (queues, unacked messages)."""
        return f"{self.prefix}:celery:"
