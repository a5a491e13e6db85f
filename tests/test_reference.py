"""docs/reference.md is the product's contract, so it keeps up with the product: every command and
flag of the CLI, every error code, every event type and every benchmark key the smoke test holds
the benchmark to are in it, and no file of the repository sends its reader to a contract outside."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import click
import typer

from celery_agents import errors
from celery_agents.cli.main import app
from celery_agents.model import EventType
from tests.bench.test_bench_smoke import CONTRACT_KEYS, DBOS_KEYS

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def synopsis() -> str:
    """The CLI section's block of commands."""
    section = REFERENCE.split("## The CLI", 1)[1]
    return section.split("```", 2)[1]


def commands() -> dict[str, list[str]]:
    """Every command of the typer app, `agents session approve`, with its options' long names."""
    found: dict[str, list[str]] = {}

    def visit(command: Any, path: str, ctx: click.Context) -> None:
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                visit(sub, f"{path} {name}", click.Context(sub, info_name=name, parent=ctx))
            return
        params = command.get_params(ctx)
        found[path] = [o for p in params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)]

    root = typer.main.get_command(app)
    visit(root, "agents", click.Context(root, info_name="agents"))
    return found


def test_every_command_and_flag_of_the_cli_is_in_the_reference() -> None:
    block = synopsis()
    lines = block.splitlines()
    missing = []
    for command, options in commands().items():
        # a command's entry: its line, and the lines that continue it (indented)
        start = next((i for i, line in enumerate(lines) if re.match(rf"{re.escape(command)}( |$)", line)), None)
        if start is None:
            missing.append(command)
            continue
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        entry = " ".join(lines[start:end])
        shorts = REFERENCE.split("Short forms:", 1)[1].split("\n\n", 1)[0]
        for option in options:
            if option == "--help":
                continue
            written = option in entry or f"`{option}`" in shorts
            if not written:
                missing.append(f"{command} {option}")
    assert "agents --version" in block
    assert not missing, f"not in docs/reference.md's CLI section: {missing}"


def test_every_error_code_and_its_exit_code_are_in_the_reference() -> None:
    codes = {
        cls.code: cls.exit_code
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.AgentsError) and "code" in vars(cls)
    }
    table = REFERENCE.split("### Exit codes and errors", 1)[1].split("\n\n", 2)[1]
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.*) \|$", table, re.M)}
    internal = {"invalid_entry"}  # a stream entry that cannot be read: recorded as rejected, never printed
    wrong = [
        f"{code} (exit {exit_code})"
        for code, exit_code in codes.items()
        if code not in internal and f"`{code}`" not in rows.get(exit_code, "")
    ]
    assert not wrong, f"codes missing from their exit code's row: {wrong}"


def test_every_event_type_is_in_the_reference() -> None:
    events = REFERENCE.split("Event types:", 1)[1].split("\n\n", 1)[0]
    assert not [e.value for e in EventType if f"`{e.value}`" not in events]


def test_every_benchmark_key_the_smoke_test_checks_is_in_the_reference() -> None:
    keys = REFERENCE.split("## Benchmark keys", 1)[1]
    assert not [k for k in (*CONTRACT_KEYS, *DBOS_KEYS[:3]) if f"`{k}`" not in keys]


def test_no_file_sends_its_reader_to_a_contract_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    citing = [
        name
        for name in tracked
        if name
        and (ROOT / name).is_file()
        and name != "tests/test_reference.py"
        and "contract.md" in (ROOT / name).read_text(errors="replace")
    ]
    assert not citing, f"these cite contract.md, which is not in the repository: {citing}"
