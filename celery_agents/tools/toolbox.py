"""Toolboxes of agents-exe style executables: `describe` says what the tool is, `run` runs it.

A toolbox is a folder (every executable file in it is a tool) or one executable. `X describe`
prints the tool's JSON description, as agents-exe's bash tools do:

    {"slug": "...", "description": "...",
     "args": [{"name", "description", "type", "backing_type", "arity": "single" | "optional",
               "mode": "positional" | "dashdashspace" | "dashdashequal" | "stdin"}],
     "empty-result": {"tag": "AddMessage", "contents": "..."},   (optional)
     "output-media-type": "image/png"}                          (optional)

or, instead of `args`, a JSON Schema under `parameters` (the arguments then arrive as one JSON
object on stdin). `X run ...` executes it: `args` are passed as their `mode` says. The tools are
described when the agent is resolved (`resolve.py`); the stored agent carries them as `script`
tools.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from celery_agents.model.agent import ScriptArg, Toolbox
from celery_agents.tools.process import run_process

DESCRIBE_TIMEOUT = 10.0
_JSON_TYPES = {"string", "number", "integer", "boolean"}


class ToolboxError(Exception):
    """A toolbox that cannot be used; the message names the path and the fix."""


def _executables(path: Path, name_filter: str | None) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ToolboxError(
            f"{path}: no such folder or file (fix the path; relative paths start at the agent file's folder)"
        )
    found = []
    for entry in sorted(path.iterdir()):
        if name_filter and name_filter not in entry.name:
            continue
        if entry.is_file() and os.access(entry, os.X_OK) and not entry.name.startswith("."):
            found.append(entry)
    return found


def describe_executable(path: Path) -> dict[str, Any]:
    """`path describe` as JSON; `ToolboxError` when it does not answer one."""
    res = run_process(
        [str(path), "describe"],
        b"",
        env=dict(os.environ),
        cwd=str(path.parent),
        timeout=DESCRIBE_TIMEOUT,
        output_cap=1_000_000,
    )
    if res.exit_status != 0:
        why = res.stderr.decode(errors="replace").strip() or (
            "timed out" if res.timed_out else f"exit status {res.exit_status}"
        )
        raise ToolboxError(
            f"{path}: `{path.name} describe` failed: {why} "
            "(make it print its JSON description, or move it out of the toolbox folder)"
        )
    try:
        info = json.loads(res.stdout.decode(errors="replace"))
    except json.JSONDecodeError as exc:
        raise ToolboxError(
            f"{path}: `{path.name} describe` did not print JSON ({exc.msg}); "
            'it must print {"slug", "description", "args"}'
        ) from None
    if not isinstance(info, dict) or not isinstance(info.get("slug"), str):
        raise ToolboxError(f'{path}: the description has no "slug" (add the tool\'s name as "slug")')
    return info


def schema_of_args(args: list[ScriptArg]) -> dict[str, Any]:
    """The JSON Schema the model sees for agents-exe `args`."""
    props = {}
    for arg in args:
        kind = arg.type if arg.type in _JSON_TYPES else "string"
        props[arg.name] = {"type": kind, "description": arg.description} if arg.description else {"type": kind}
    required = [a.name for a in args if a.arity == "single"]
    return {"type": "object", "properties": props, **({"required": required} if required else {})}


def tool_from_description(path: Path, info: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The `script` tool entry (agent file form) for one described executable."""
    tool: dict[str, Any] = {
        "name": f"{prefix}{info['slug']}",
        "description": str(info.get("description") or ""),
        "script": str(path),
    }
    if isinstance(info.get("args"), list):
        try:
            args = [ScriptArg.model_validate(a) for a in info["args"]]
        except ValueError as exc:
            raise ToolboxError(f"{path}: its description's args are invalid: {exc}") from None
        tool["scriptArgs"] = [a.model_dump(by_alias=True) for a in args]
        tool["parameters"] = schema_of_args(args)
    elif isinstance(info.get("parameters"), dict):
        tool["parameters"] = info["parameters"]
    empty = info.get("empty-result")
    if isinstance(empty, dict) and empty.get("tag") == "AddMessage":
        tool["emptyResult"] = str(empty.get("contents") or "")
    if isinstance(info.get("output-media-type"), str):
        tool["outputMediaType"] = info["output-media-type"]
    return tool


def describe_toolbox(box: Toolbox, base_dir: str | None) -> list[dict[str, Any]]:
    """Every tool of a toolbox, in the agent file's form (`script` tools)."""
    path = Path(box.path).expanduser()
    if not path.is_absolute():
        path = Path(base_dir or os.getcwd()) / path
    return [
        tool_from_description(exe.resolve(), describe_executable(exe), box.prefix)
        for exe in _executables(path.resolve(), box.filter)
    ]


def script_invocation(
    script: str, args: list[ScriptArg] | None, arguments: dict[str, Any]
) -> tuple[list[str], bytes] | str:
    """(argv, stdin) of `script run` for these arguments (agents-exe modes, or JSON on stdin), or
    the error the model gets when a value cannot be passed as its mode says without changing the
    command: a stdin value is one line, and a positional or `--name value` value that starts with
    `-` would be read as an option."""
    if args is None:
        return [script, "run"], json.dumps(arguments).encode()
    argv, lines = [script, "run"], []
    for arg in args:
        if arg.name not in arguments or arguments[arg.name] is None:
            continue
        value = arguments[arg.name]
        text = value if isinstance(value, str) else json.dumps(value)
        problem = _unpassable(arg, text)
        if problem:
            return f"argument {arg.name!r} {problem}; call the tool again with a value that does not"
        if arg.mode == "positional":
            argv.append(text)
        elif arg.mode == "dashdashspace":
            argv += [f"--{arg.name}", text]
        elif arg.mode == "dashdashequal":
            argv.append(f"--{arg.name}={text}")
        else:
            lines.append(text)
    return argv, ("".join(f"{line}\n" for line in lines)).encode()


def _unpassable(arg: ScriptArg, text: str) -> str | None:
    """Why `text` cannot be passed as `arg`'s mode says, or None."""
    if "\0" in text:
        return "contains a NUL character, which no command argument can carry"
    if arg.mode == "stdin" and ("\n" in text or "\r" in text):
        return "goes to the tool as one line of its input and must not contain a line break"
    if arg.mode in ("positional", "dashdashspace") and text.startswith("-"):
        return "starts with '-', which the tool would read as an option rather than as this argument's value"
    return None
