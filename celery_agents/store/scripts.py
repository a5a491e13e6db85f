"""The Lua scripts of `store/lua/`, loaded once per client and called by name.

Session scripts get `_lib.lua` prepended (events, finishing a call, ...) and before it their key
table: `K` names each key the script touches, found in its source and in the functions of
`_lib.lua` it calls (`key_names`), and the store passes those keys and no others. They are run
with EVALSHA and loaded again when the server answers NOSCRIPT (a Redis restart, or a failover:
Redis does not replicate its script cache, so a promoted replica has none of them). A store that
waits for replicas (store/replication.py) sends each writing script with its `WAIT` in one
pipeline. Every writing session script runs inside `_lib.lua`'s `once`: a retry of the same call
returns the first reply; but `commit_step`, which keeps its last reply in the header it writes
anyway (no request key to read and write on every step).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

import redis
from redis.exceptions import NoScriptError

from celery_agents.store.connection import translated
from celery_agents.store.keys import SCRIPT_KEY_NAMES, STORED_STATES, Keys
from celery_agents.store.replication import MasterMoved, ReplicaAcks

#: scripts that are not a session's: their KEYS are named in their own opening comment
STANDALONE = frozenset(
    {
        "journal_put",
        "lease_renew",
        "watch",
        "admit",
        "release",
        "slot_renew",
        "claim_budget",
        "claim_renew",
        "settle_claim",
    }
)
# Session scripts that only read, or whose repetition is harmless and whose reply is the whole
# session (begin_step: the same owner takes its own lease again), or that answer their own retries
# (commit_step: `last_commit` in the header), or that change nothing a reader sees (pack_waiting):
# not wrapped in `once`.
_NOT_ONCE = frozenset({"begin_step", "load_session", "commit_step", "pack_waiting"})
#: scripts that write nothing: no replica has anything to acknowledge
_READ_ONLY = frozenset({"load_session"})


_FUNCTION = re.compile(r"^local function (\w+)\(", re.M)
_KEY = re.compile(r"\bK\.(\w+)")


def _read(name: str) -> str:
    return resources.files("celery_agents.store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


@cache
def _lib_functions() -> dict[str, str]:
    """`_lib.lua`'s top-level functions by name: each one's text, up to the next one."""
    lib = _read("_lib")
    starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(lib)]
    ends = [start for start, _ in starts[1:]] + [len(lib)]
    return {fn: lib[start:end] for (start, fn), end in zip(starts, ends, strict=True)}


@cache
def key_names(name: str) -> tuple[str, ...]:
    """The keys a session script touches, in the order of `SCRIPT_KEY_NAMES`: those its source
    names (`K.meta`, `STATE_KEYS`: every state's index) and those of the `_lib.lua` functions it
    calls, and theirs; `request` when it runs inside `once`."""
    functions = _lib_functions()
    body = _body(name)
    seen: set[str] = set()
    todo = [body]
    while todo:
        text = todo.pop()
        for fn in functions:
            if fn not in seen and re.search(rf"\b{fn}\(", text):
                seen.add(fn)
                todo.append(functions[fn])
    texts = [body, *(functions[fn] for fn in seen)]
    used = {k for text in texts for k in _KEY.findall(text)}
    unknown = used - set(SCRIPT_KEY_NAMES)
    if unknown:
        raise ValueError(f"{name}.lua names keys store/keys.py does not define: {sorted(unknown)}")
    if any("STATE_KEYS" in text for text in texts):
        used |= {f"state:{s}" for s in STORED_STATES}
    return tuple(n for n in SCRIPT_KEY_NAMES if n in used)


def _body(name: str) -> str:
    body = _read(name)
    return body if name in _NOT_ONCE else f"return once(function()\n{body}\nend)\n"


def _key_table(names: tuple[str, ...]) -> str:
    """`K`, `STATE_KEYS` and `NKEYS` for a script given `names` in this order in KEYS."""
    index = {n: i + 1 for i, n in enumerate(names)}
    plain = ", ".join(f"{n} = KEYS[{i}]" for n, i in index.items() if not n.startswith("state:"))
    states = ", ".join(f"{n[len('state:') :]} = KEYS[{i}]" for n, i in index.items() if n.startswith("state:"))
    return f"local K = {{{plain}}}\nlocal STATE_KEYS = {{{states}}}\nlocal NKEYS = {len(names)}\n"


#: standalone scripts that share functions of their own (`lua/_claims.lua`), put before them
_INCLUDES = {"claim_budget": "_claims", "settle_claim": "_claims"}


@cache
def script_source(name: str) -> str:
    if name in STANDALONE:
        included = _INCLUDES.get(name)
        return f"{_read(included)}\n{_read(name)}" if included else _read(name)
    return f"{_key_table(key_names(name))}{_read('_lib')}\n{_body(name)}"


@cache
def _names() -> tuple[str, ...]:
    lua = resources.files("celery_agents.store").joinpath("lua")
    return tuple(sorted(p.name[:-4] for p in lua.iterdir() if p.name.endswith(".lua") and not p.name.startswith("_")))


def script_names() -> list[str]:
    return list(_names())


class Scripts:
    """Named access to the scripts for one Redis client: `scripts.run("commit_step", keys, args)`."""

    def __init__(self, client: redis.Redis, acks: ReplicaAcks | None = None) -> None:
        self._client = client
        self.acks = acks or ReplicaAcks(0)
        #: each script made on its first use: making all 28 (their key tables found in their
        #: sources) took ~65 ms, a fifth of a read-only CLI command that runs none of them
        self._scripts: dict[str, Any] = {}

    def _script(self, name: str) -> Any:
        script = self._scripts.get(name)
        if script is None:
            if name not in _names():
                raise KeyError(name)
            script = self._scripts[name] = self._client.register_script(script_source(name))
        return script

    def sha(self, name: str) -> str:
        """The SHA1 a script is called by (EVALSHA)."""
        return str(self._script(name).sha)

    def load_all(self) -> None:
        """Load every script into the server now (instead of at its first call)."""
        for name in _names():
            self._client.script_load(self._script(name).script)

    def run(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """The script's reply. On a pipeline (`client`), queued as it is; on this client, followed
        by `WAIT` when writes wait for replicas."""
        if client is None and name not in _READ_ONLY and self.acks.replicas:
            if self.acks.waiting:
                return self._run_acknowledged(name, keys, args)
            self.acks.unwaited()
        script = self._script(name)
        if client is not None and hasattr(client, "queue_script"):  # a Cluster's pipeline
            return client.queue_script(script.sha, script.script, keys, args)
        return script(keys=keys, args=args, client=client or self._client)

    def _run_acknowledged(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA and WAIT in one round trip; on NOSCRIPT the script is loaded and sent again. On
        a Cluster, WAIT goes to the primary of the script's keys, on the same connection. Sent
        again when the master that took it was replaced or is being replaced
        (`ReplicaAcks.acknowledged`)."""
        script = self._script(name)
        node_of = getattr(self._client, "node_of", None)

        def send() -> tuple[Any, object, tuple[Any, Any] | None]:
            for attempt in (1, 2):
                pipe = self._client.pipeline(transaction=False)
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                self.acks.queue(pipe, node_of(keys[0]) if node_of is not None and keys else None)
                reply, replicas = pipe.execute(raise_on_error=False)
                if isinstance(reply, NoScriptError) and attempt == 1:
                    script.sha = self._client.script_load(script.script)
                    continue
                if isinstance(reply, redis.RedisError):
                    raise translated(reply)
                return reply, replicas, getattr(pipe, "served_by", None)
            raise AssertionError("unreachable")

        try:
            return self.acks.acknowledged(send)
        except MasterMoved as moved:
            raise translated(moved) from None

    @staticmethod
    def session_keys(name: str, keys: Keys, sid: str, request_id: str, *extra: str) -> list[str]:
        """The KEYS of session script `name` for session `sid`: the keys it touches (`key_names`),
        then `extra`."""
        return [*keys.named(key_names(name), sid, request_id), *extra]
