"""The names the Lua scripts share with Python are the same in both languages: the key table,
the states that owe a step, the outcomes a script may reply and the events it may emit."""

from __future__ import annotations

import re
from importlib import resources

from celery_agents.model import REFUSALS, SCRIPT_OUTCOMES, STEP_OWING_STATES, EventType
from celery_agents.store.keys import SCRIPT_KEY_NAMES, Keys
from celery_agents.store.scripts import STANDALONE, key_names, script_names, script_source


def lua(name: str) -> str:
    return resources.files("celery_agents.store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def table(source: str, name: str) -> str:
    found = re.search(rf"local {name} = \{{(.*?)\n?\}}", source, re.S)
    assert found, f"_lib.lua defines no table {name}"
    return found.group(1)


LIB = lua("_lib")
SCRIPTS = {name: lua(name) for name in script_names()}


def test_each_script_names_in_its_key_table_the_keys_it_is_passed_in_that_order() -> None:
    """A session script's `K` and `STATE_KEYS` (written by store/scripts.py) index exactly the keys
    the store passes it (`Keys.named`), in order, and its extra keys start right after them."""
    keys = Keys("p")
    for name in SCRIPTS:
        if name in STANDALONE:  # their KEYS are in their own header
            continue
        source = script_source(name)
        indexed = re.findall(r"(\w+) = KEYS\[(\d+)\]", table(source, "K") + table(source, "STATE_KEYS"))
        in_lua = {int(i): n for n, i in indexed}
        names = key_names(name)
        passed = keys.named(names, "sid", "rid")
        assert sorted(in_lua) == list(range(1, len(names) + 1)), name
        for i, n in in_lua.items():
            want = keys.state_index(n) if f"state:{n}" in names else keys.named((n,), "sid", "rid")[0]
            assert passed[i - 1] == want, (name, n)
        nkeys = re.search(r"local NKEYS = (\d+)", source)
        assert nkeys and int(nkeys.group(1)) == len(names), f"{name}: extra keys start right after its keys"


def test_every_key_a_script_names_is_in_its_key_table() -> None:
    """What a script (and each `_lib.lua` function it calls) names as `K.<key>` is passed to it: a
    missing one would be nil in Lua, and a key outside KEYS breaks Redis Cluster. A script gets
    only those: no more the same 25 keys for all."""
    for name in SCRIPTS:
        if name in STANDALONE:
            continue
        table_names = set(re.findall(r"(\w+) = KEYS\[", table(script_source(name), "K")))
        assert set(re.findall(r"\bK\.(\w+)", SCRIPTS[name])) <= table_names, name
        for fn in re.findall(r"^local function (\w+)\(", LIB, re.M):
            if re.search(rf"\b{fn}\(", SCRIPTS[name]):
                own = re.search(rf"^local function {fn}\(.*?^end$", LIB, re.M | re.S)
                assert own, fn
                assert set(re.findall(r"\bK\.(\w+)", own.group(0))) <= table_names, (name, fn)
    assert len(key_names("warn_call")) < len(SCRIPT_KEY_NAMES) and "counters" not in key_names("warn_call")


def test_lib_owes_a_step_in_the_states_the_model_says() -> None:
    assert set(re.findall(r"(\w+) = true", table(LIB, "OWES_STEP"))) == {s.value for s in STEP_OWING_STATES}


def test_lib_refusals_are_the_models() -> None:
    assert set(re.findall(r"(\w+) = true", table(LIB, "REFUSALS"))) == REFUSALS
    assert REFUSALS <= SCRIPT_OUTCOMES


def test_every_script_replies_a_known_outcome() -> None:
    for name, source in SCRIPTS.items():
        for outcome in re.findall(r"return \{'(\w+)'", source):
            assert outcome in SCRIPT_OUTCOMES, f"{name}.lua replies {outcome!r}, not a ScriptOutcome"


def test_every_event_a_script_emits_is_an_event_type() -> None:
    emitted = set()
    for source in [LIB, *SCRIPTS.values()]:
        emitted |= set(re.findall(r"emit\('(\w+)'", source))
        emitted |= set(re.findall(r"finish_call\([^)]*?'(\w+)',", source))
    assert emitted, "the pattern finds the scripts' events"
    assert emitted <= {e.value for e in EventType}


def _calls_of(function: str, source: str) -> list[list[str]]:
    """The arguments of every call of `function` in `source`, split at top-level commas."""
    found = []
    for start in (m.end() for m in re.finditer(rf"(?<![\w.]){function}\(", source)):
        args, depth, word = [], 0, ""
        for ch in source[start:]:
            if ch == ")" and depth == 0:
                break
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                args.append(word.strip())
                word = ""
            else:
                word += ch
        found.append([*args, word.strip()])
    return found


def test_every_series_a_script_counts_is_served_with_as_many_labels() -> None:
    from celery_agents.observe.metrics import FLEET_COUNTERS

    sources = [LIB, *SCRIPTS.values()]
    counted = [args for source in sources for args in _calls_of("count", source) if args != ["..."]]
    counted += [args[1:] for source in sources for args in _calls_of("count_of", source) if args != ["n", "..."]]
    assert len(counted) > 10, "the pattern finds the scripts' counts"
    for args in counted:
        series = args[0].strip("'")
        assert series in FLEET_COUNTERS, f"count({', '.join(args)}): no such series"
        assert len(args) - 1 == len(FLEET_COUNTERS[series][1]), f"count({', '.join(args)}): its labels"


def test_a_refused_step_counts_as_the_outcome_the_runtime_names_it() -> None:
    from celery_agents.runtime.step import _STEP_OUTCOMES

    assert dict(re.findall(r"(\w+) = '(\w+)'", table(LIB, "STEP_OUTCOMES"))) == _STEP_OUTCOMES
    for name in ("begin_step", "commit_step"):
        for [reply, *_] in _calls_of("refused", SCRIPTS[name]):
            if reply != "reply":
                assert reply.strip("'") in _STEP_OUTCOMES, f"{name}.lua refuses {reply}"
