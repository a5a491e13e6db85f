"""The Lua scripts of `store/lua/`, loaded once per client and called by name.

Session scripts get `_lib.lua` prepended (key names, events, finishing a call); they are run with
EVALSHA and reloaded transparently after a Redis restart (redis-py `Script`). Every writing session
script runs inside `_lib.lua`'s `once`: a retry of the same call returns the first reply; but
`commit_step`, which keeps its last reply in the header it writes anyway (no request key to read
and write on every step).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis

_STANDALONE = frozenset({"journal_put", "lease_renew"})
# Session scripts that only read, or whose repetition is harmless and whose reply is the whole
# session (begin_step: the same owner takes its own lease again), or that answer their own retries
# (commit_step: `last_commit` in the header): not wrapped in `once`.
_NOT_ONCE = frozenset({"begin_step", "load_session", "commit_step"})


@cache
def script_source(name: str) -> str:
    lua = resources.files("celery_agents.store").joinpath("lua")
    body = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name in _STANDALONE:
        return body
    lib = lua.joinpath("_lib.lua").read_text(encoding="utf-8")
    if name in _NOT_ONCE:
        return lib + "\n" + body
    return f"{lib}\nreturn once(function()\n{body}\nend)\n"


def script_names() -> list[str]:
    lua = resources.files("celery_agents.store").joinpath("lua")
    return sorted(p.name[:-4] for p in lua.iterdir() if p.name.endswith(".lua") and not p.name.startswith("_"))


class Scripts:
    """Named access to the scripts for one Redis client: `scripts.run("commit_step", keys, args)`."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._scripts = {name: client.register_script(script_source(name)) for name in script_names()}

    def sha(self, name: str) -> str:
        """The SHA1 a script is called by (EVALSHA)."""
        return str(self._scripts[name].sha)

    def load_all(self) -> None:
        """Load every script into the server now (instead of at its first call)."""
        for name in self._scripts:
            self._client.script_load(script_source(name))

    def run(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        return self._scripts[name](keys=keys, args=args, client=client or self._client)
