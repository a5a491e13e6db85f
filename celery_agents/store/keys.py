"""Every Redis key celery-agents uses, named here and nowhere else.

Session keys carry the hash tag `{<session_id>}` so that one session's keys share a Cluster slot.
Scripts receive their keys in `KEYS` in the fixed order of `session_keys` + `global_keys`.
"""

from __future__ import annotations

from celery_agents.model import State

SESSION_KEY_NAMES = ("meta", "turns", "calls", "results", "pending", "journal", "events", "lease", "inbox", "children")
#: the shared keys a session script gets after the session's (then one index per stored state)
SHARED_KEY_NAMES = ("sessions", "pending_all", "deadlines", "owed", "dispatched")
#: the states a session is stored in, each with its index (`running` is only ever shown)
STORED_STATES = tuple(s.value for s in State if s is not State.RUNNING)
#: the states of a session that no longer runs: the ones `delete` and `purge` take
FINISHED_STATES = (State.COMPLETED.value, State.FAILED.value, State.CANCELLED.value)
#: a session script's KEYS by name, in order (`script_keys`); `_lib.lua`'s `K`, `STATE_KEYS` and
#: `NKEYS` are checked against it (tests/store/test_lua_contract.py)
SCRIPT_KEY_NAMES = (
    *SESSION_KEY_NAMES,
    *SHARED_KEY_NAMES,
    *(f"state:{s}" for s in STORED_STATES),
    "request",
)


class Keys:
    """Key builder for one prefix (default `agents`)."""

    def __init__(self, prefix: str = "agents") -> None:
        self.prefix = prefix

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
        """Set of call fields still unfinished."""
        return self.session(sid, "pending")

    def journal(self, sid: str) -> str:
        """Hash of work done by the step in flight (LLM response, inline tool results)."""
        return self.session(sid, "journal")

    def events(self, sid: str) -> str:
        """Stream of the session's events, capped."""
        return self.session(sid, "events")

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
    def sessions(self) -> str:
        """Sorted set: session ids by last update (ms)."""
        return f"{self.prefix}:sessions"

    def state_index(self, state: str) -> str:
        """Sorted set: session ids in one stored state, by last update (ms)."""
        return f"{self.prefix}:state:{state}"

    @property
    def pending_all(self) -> str:
        """Sorted set: `<session_id> <field>` of every unfinished call, by creation (ms)."""
        return f"{self.prefix}:pending"

    @property
    def deadlines(self) -> str:
        """Sorted set: `<session_id> <field>` of deferred calls, by deadline (ms)."""
        return f"{self.prefix}:deadlines"

    @property
    def owed(self) -> str:
        """Sorted set: sessions owed a step (the outbox), by when it became owed (ms)."""
        return f"{self.prefix}:owed"

    @property
    def dispatched(self) -> str:
        """Sorted set: `<session_id> <field>` of runAsync/runIsolated calls not finished, by when
        they were last dispatched or seen running (ms)."""
        return f"{self.prefix}:dispatched"

    @property
    def ids(self) -> str:
        """Sorted set, every score 0: session ids in lexicographic order, so that a prefix of an
        id is found with ZRANGEBYLEX (no scan). Kept by create_session, cleaned by delete_session."""
        return f"{self.prefix}:ids"

    def global_keys(self) -> list[str]:
        shared: list[str] = [getattr(self, name) for name in SHARED_KEY_NAMES]
        return shared + [self.state_index(s) for s in STORED_STATES]

    def script_keys(self, sid: str, request_id: str, *extra: str) -> list[str]:
        """A session script's keys: the session's, the shared ones, the call's request key, extras."""
        return [*self.session_keys(sid), *self.global_keys(), self.request(sid, request_id), *extra]

    def agent(self, content_hash: str) -> str:
        """String: an agent spec (canonical JSON), stored once per content hash."""
        return f"{self.prefix}:agent:{content_hash}"

    def agent_signature(self, content_hash: str) -> str:
        """String: the HMAC-SHA256 of the spec under `agent(content_hash)` (AGENTS_SPEC_KEY)."""
        return f"{self.prefix}:agent:{content_hash}:sig"

    @property
    def completions(self) -> str:
        """Stream other systems XADD completions to (`token`, `result`, `error`, `by`)."""
        return f"{self.prefix}:completions"

    @property
    def rejected(self) -> str:
        """Stream: completions that changed nothing, with the reason."""
        return f"{self.prefix}:completions:rejected"

    @property
    def rewound(self) -> str:
        """Hash: session id -> what a worker saw when it found the stored session older than
        what it had read before (Redis lost writes); shown by `agents doctor`."""
        return f"{self.prefix}:rewound"

    @property
    def workers(self) -> str:
        """Hash: worker name -> heartbeat JSON."""
        return f"{self.prefix}:workers"

    def fault(self, name: str) -> str:
        """String: set by a worker paused at a fault-injection checkpoint (tests only)."""
        return f"{self.prefix}:fault:{name}"

    def lock(self, name: str) -> str:
        return f"{self.prefix}:lock:{name}"

    @property
    def poison(self) -> str:
        """List: queue messages no worker could read, set aside with their queue and the reason
        (JSON, newest first, capped); written by `tasks/broker.py` through the broker's prefix."""
        return f"{self.celery_prefix}poison"

    @property
    def celery_prefix(self) -> str:
        """Prefix of the Celery broker's own keys (queues, unacked messages)."""
        return f"{self.prefix}:celery:"
