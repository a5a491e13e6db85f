"""The names the Lua scripts share with Python are the same in both languages: the key table,
the states that owe a step, the outcomes a script may reply and the events it may emit."""

from __future__ import annotations

import re
from importlib import resources

from celery_agents.model import REFUSALS, SCRIPT_OUTCOMES, STEP_OWING_STATES, EventType
from celery_agents.store.keys import SCRIPT_KEY_NAMES
from celery_agents.store.scripts import script_names


def lua(name: str) -> str:
    return resources.files("celery_agents.store").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def table(source: str, name: str) -> str:
    found = re.search(rf"local {name} = \{{(.*?)\n?\}}", source, re.S)
    assert found, f"_lib.lua defines no table {name}"
    return found.group(1)


LIB = lua("_lib")
SCRIPTS = {name: lua(name) for name in script_names()}


def test_lib_key_table_is_the_order_keys_py_passes_them_in() -> None:
    indexed = re.findall(r"(\w+) = KEYS\[(\d+)\]", table(LIB, "K") + table(LIB, "STATE_KEYS"))
    in_lua = {name: int(i) for name, i in indexed}
    stored_states = {name for name in in_lua if f"state:{name}" in SCRIPT_KEY_NAMES}
    in_python = {
        n.removeprefix("state:") if n.removeprefix("state:") in stored_states else n: i + 1
        for i, n in enumerate(SCRIPT_KEY_NAMES)
    }
    assert in_lua == in_python
    nkeys = re.search(r"local NKEYS = (\d+)", LIB)
    assert nkeys and int(nkeys.group(1)) == len(SCRIPT_KEY_NAMES), "extra keys start right after the script keys"


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
