"""The test run's warm launcher forks the workers and commands of every test, not only of the
first: what pytest changes in the environment from test to test does not force a fresh
interpreter (~10 s of imports each)."""

from __future__ import annotations

import os

import pytest

from tests.cli.process import CLI, cli_env
from tests.support.launcher import launcher


@pytest.mark.parametrize("n", [1, 2])
def test_each_test_may_fork_its_commands(n: int) -> None:
    env = cli_env(None, "agents")
    assert env.get("PYTEST_CURRENT_TEST", "").endswith(f"[{n}] (call)")
    differ = launcher().differences(env)
    assert launcher().can_fork(list(CLI), env), f"a command of this test would be exec'd afresh: {differ} differ"


def test_an_environment_that_differs_is_still_execd() -> None:
    env = {**cli_env(None, "agents"), "SOME_LIBRARY_SETTING": "1"}
    assert not launcher().can_fork(list(CLI), env)
    assert "SOME_LIBRARY_SETTING" not in os.environ


def test_what_an_in_process_model_call_sets_still_forks() -> None:
    """A test that calls litellm in the test process leaves LITELLM_LOG (`ensure_litellm`) and
    TIKTOKEN_CACHE_DIR (litellm's import) in its environment, as every worker has them: the
    commands of later tests still fork."""
    env = {**cli_env(None, "agents"), "LITELLM_LOG": "ERROR", "TIKTOKEN_CACHE_DIR": "/somewhere/tokenizers"}
    assert launcher().can_fork(list(CLI), env)
