"""Reading an agent file: its JSON to an `AgentFile`, refused with messages naming the file, the
field and the fix before anything is stored.

Reading is pure: it validates the file (and reads the files of its path sub-agents), and imports
no tool code, runs no process and opens no connection. What a file leaves to be found out, the
tools its toolboxes describe, the tools its MCP servers list and the schema of a python tool that
declares no `parameters`, is resolved by `celery_agents.tools.resolve`, which hands those values
back as a `Resolution` to `AgentFile.resolved`: the spec a session stores names every tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from celery_agents.errors import InvalidAgentFile
from celery_agents.model.agent import (
    DISPOSITION_TAGS,
    AgentSpec,
    Toolbox,
    ToolCallPolicy,
    ToolSpec,
    normalise_toolboxes,
)
from celery_agents.model.limits import UnusableJson, check_depth, load_json
from celery_agents.model.mcp import McpServer, normalise_servers

#: a sub-agent's nesting limit unless its top agent's file sets `maxDepth`
DEFAULT_MAX_DEPTH = 4


@dataclass(frozen=True)
class Resolution:
    """What resolving an agent file found, as plain values in the agent file's own form."""

    #: the tool entries each toolbox describes, in `toolboxes` order
    toolbox_tools: tuple[tuple[dict[str, Any], ...], ...] = ()
    #: the tool entries each MCP server lists, in `mcpServers` order
    mcp_tools: tuple[tuple[dict[str, Any], ...], ...] = ()
    #: (JSON Schema, first paragraph of the docstring) of python tools, by tool name; a tool
    #: whose function could not be loaded is absent and keeps the empty schema
    signatures: Mapping[str, tuple[dict[str, Any], str]] = field(default_factory=dict)
    #: the sub-agents, resolved, in `subAgents` order
    sub_agents: tuple[AgentSpec, ...] = ()


@dataclass(frozen=True)
class AgentFile:
    """An agent file read and validated as it is written, and what it leaves to resolve.

    `declared` is the agent with the tools the file itself declares (a policy rule may name a tool
    its toolboxes or servers are still to list); `resolved` makes the spec a session stores from
    what `celery_agents.tools.resolve` found."""

    #: the file's path, or where in the input the agent stands, for messages
    source: str
    #: the JSON the spec is validated from: servers as a list, `baseDir` set, sub-agents declared
    data: Mapping[str, Any]
    declared: AgentSpec
    toolboxes: tuple[Toolbox, ...] = ()
    mcp_servers: tuple[McpServer, ...] = ()
    #: python tools declaring no `parameters`: their signature is their schema
    python_tools: tuple[ToolSpec, ...] = ()
    sub_agents: tuple[AgentFile, ...] = ()

    @property
    def base_dir(self) -> str | None:
        return self.declared.base_dir

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """Fields of the file, written as paths, that agents-exe knows and celery-agents ignores."""
        return self.declared.ignored_fields

    @property
    def unresolved(self) -> bool:
        """Whether anything is left to find out, here or in a sub-agent."""
        return bool(self.toolboxes or self.mcp_servers or self.python_tools) or any(
            sub.unresolved for sub in self.sub_agents
        )

    def resolved(self, found: Resolution) -> AgentSpec:
        """The agent with what resolving found: the described and listed tools after the file's
        own (a tool already declared under the same name is kept as written), python tools with
        their signature's schema, the sub-agents resolved. Validated again as a whole."""
        if not self.unresolved:
            return self.declared
        tools = [_with_signature(t, found.signatures) for t in self.data.get("tools") or []]
        names = {t.get("name") for t in tools if isinstance(t, dict)}
        for described in found.toolbox_tools:
            tools.extend(t for t in described if t["name"] not in names)
            names.update(t["name"] for t in described)
        for listed in found.mcp_tools:
            for entry in listed:
                if entry["name"] not in names:
                    tools.append(entry)
                    names.add(entry["name"])
        data = {**self.data, "tools": tools}
        if self.sub_agents:
            data["subAgents"] = [_dumped(sub) for sub in found.sub_agents]
        return _validated(data, self.source, self.declared.ignored_fields)


def _with_signature(tool: Any, signatures: Mapping[str, tuple[dict[str, Any], str]]) -> Any:
    """A python tool's entry with its signature's schema (and its docstring's summary as the
    description when it has none)."""
    if not (isinstance(tool, dict) and tool.get("python") and "parameters" not in tool):
        return tool
    found = signatures.get(str(tool.get("name")))
    if found is None:
        return tool
    tool = {**tool, "parameters": found[0]}
    if not tool.get("description") and found[1]:
        tool["description"] = found[1]
    return tool


def _dumped(spec: AgentSpec) -> dict[str, Any]:
    return spec.model_dump(mode="json", by_alias=True, exclude_none=True)


def _validated(
    data: Mapping[str, Any], source: str, ignored: tuple[str, ...], *, unresolved: bool = False
) -> AgentSpec:
    try:
        spec = AgentSpec.model_validate(data, context={"unresolved": unresolved})
    except ValidationError as exc:
        message = describe_validation_error(source, exc)
        if "toolCallPolicyConfig" in data:
            # The file spells the policy the agents-exe way: name its fields as the file does.
            message = re.sub(r"\btoolCallPolicy(?=[.\[:])", "toolCallPolicyConfig", message)
        raise InvalidAgentFile(message, file=source) from None
    spec._ignored = ignored
    return spec


_FIX_HINTS = {
    "missing": "add it",
    "literal_error": "use one of the allowed values",
    "extra_forbidden": "remove it",
    "string_type": "give a string",
    "int_type": "give a whole number",
    "int_parsing": "give a whole number",
    "float_type": "give a number",
    "float_parsing": "give a number",
    "bool_type": "give true or false",
    "list_type": "give a JSON list",
    "dict_type": "give a JSON object",
    "model_type": "give a JSON object",
    "greater_than": "give a larger number",
    "greater_than_equal": "give a larger number",
    "less_than_equal": "give a smaller number",
}


def _loc(parts: tuple[Any, ...]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("function-after[_check_tools()]",) or str(p).startswith(("function-", "tagged-union")):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or "(top level)"


def describe_validation_error(source: str, exc: ValidationError) -> str:
    """One line per problem: `<file>: <field>: <what is wrong> — <fix>`."""
    lines = []
    for err in exc.errors(include_url=False):
        field = _loc(tuple(err.get("loc", ())))
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        kind = str(err.get("type", ""))
        hint = _FIX_HINTS.get(kind)
        if kind == "literal_error" and field.endswith("tag"):
            hint = f"use one of {', '.join(DISPOSITION_TAGS)}"
        elif kind == "literal_error" and field.endswith("executionMode"):
            hint = 'use "synchronous" or "asynchronous"'
        if kind == "missing":
            msg = "this field is required"
        if field == "(top level)" and re.match(r"^[A-Za-z]+(\.|\[)", msg):
            lines.append(f"{source}: {msg}" + (f" ({hint})" if hint else ""))  # the message names the field
        else:
            lines.append(f"{source}: {field}: {msg}" + (f" ({hint})" if hint else ""))
    return "\n".join(lines)


# -- fields: known, unknown, and agents-exe's we do not use ------------------------------------
#: Names a model accepts besides its fields and aliases (folded in by its "before" validators).
_ALSO_ACCEPTED: dict[str, frozenset[str]] = {
    # toolCallPolicyConfig, toolDirectory and bashToolboxes: the agents-exe spellings; extraAgents
    # the agents-exe name of subAgents.
    "AgentSpec": frozenset({"toolCallPolicyConfig", "toolDirectory", "bashToolboxes", "extraAgents"}),
}

#: Fields of agents-exe agent files that celery-agents does not use: accepted with a warning.
AGENTS_EXE_FIELDS: dict[str, frozenset[str]] = {
    "AgentSpec": frozenset(
        {
            "flavor",
            "modelUrl",
            "modelName",
            "apiKeyId",
            "announce",
            "openApiToolboxes",
            "postgrestToolboxes",
            "builtinToolboxes",
            "skillSources",
            "autoEnableSkills",
            "asyncYieldStrategy",
            "maxConcurrency",
            "asyncCallTimeoutSeconds",
            "parameters",
            "bindings",
            "pauseCancelsCalls",
            "resumeOnAnyMail",
            "interruptCompletions",
            "mailInToolResult",
            "mailScope",
            "interruptScope",
            "wakeOn",
            "fileSandboxes",
        }
    ),
    "ToolCallPolicy": frozenset({"wrappers"}),
    "Disposition": frozenset({"attachSeconds", "spec"}),
}


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field's type (`X`, `X | None`, `list[X]`), if any."""
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _fields_of(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """Every name `model` accepts in a file, with the model of its value when it has one."""
    names: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        names[name] = nested
        if info.alias:
            names[info.alias] = nested
    for name in _ALSO_ACCEPTED.get(model.__name__, frozenset()):
        names.setdefault(name, ToolCallPolicy if name == "toolCallPolicyConfig" else None)
    return names


def _check_fields(model: type[BaseModel], data: Any, where: str, unknown: list[str], ignored: list[str]) -> None:
    """Walk `data` as `model` reads it: unknown names go to `unknown` (with the closest known
    name), agents-exe names we do not use to `ignored`."""
    import difflib

    if isinstance(data, list):
        for i, item in enumerate(data):
            _check_fields(model, item, f"{where}[{i}]", unknown, ignored)
        return
    if not isinstance(data, dict):
        return
    known = _fields_of(model)
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key in known:
            nested = known[key]
            if nested is not None:
                _check_fields(nested, value, path, unknown, ignored)
        elif key in AGENTS_EXE_FIELDS.get(model.__name__, frozenset()):
            ignored.append(path)
        else:
            public = sorted(k for k in known if not k.islower() or "_" not in k)
            # A field one level down, written a level too high (a rule's `network`).
            deeper = [f"{k}.{key}" for k in public if (sub := known[k]) is not None and key in _fields_of(sub)]
            close = deeper or difflib.get_close_matches(str(key), public, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"known fields here: {', '.join(public)}"
            unknown.append(f"{path}: unknown field ({hint})")


def read_agent(
    data: Any, source: str = "<agent>", base_dir: str | None = None, _chain: tuple[str, ...] = ()
) -> AgentFile:
    """Validate an agent given as a JSON value; raises `InvalidAgentFile`. A field the file
    format does not know is refused with the closest known name; a field of agents-exe files
    that celery-agents does not use is accepted and listed in `ignored_fields`."""
    if not isinstance(data, dict):
        raise InvalidAgentFile(f"{source}: (top level): an agent file is a JSON object (give {{...}})")
    try:
        check_depth(data)
    except UnusableJson as exc:
        raise InvalidAgentFile(f"{source}: (top level): not a usable agent file: {exc}", file=source) from None
    unknown: list[str] = []
    ignored: list[str] = []
    data = normalise_servers(data)
    _check_fields(AgentSpec, data, "", unknown, ignored)
    if unknown:
        raise InvalidAgentFile("\n".join(f"{source}: {line}" for line in unknown), file=source)
    if base_dir and "baseDir" not in data:
        data = {**data, "baseDir": base_dir}
    toolboxes = (
        _toolboxes(data, source) if any(k in data for k in ("toolboxes", "toolDirectory", "bashToolboxes")) else []
    )
    servers = _servers(data, source) if data.get("mcpServers") else []
    subs: list[AgentFile] = []
    if data.get("subAgents") or data.get("extraAgents"):
        data, subs = _with_sub_agents(data, source, _chain)
    declared = _validated(data, source, tuple(ignored), unresolved=True)
    if not _chain:
        _check_nesting(declared, source)
    python = tuple(
        tool
        for tool, entry in zip(declared.tools, data.get("tools") or [], strict=True)
        if tool.python and "parameters" not in entry
    )
    return AgentFile(source, data, declared, tuple(toolboxes), tuple(servers), python, tuple(subs))


def _check_nesting(spec: AgentSpec, source: str) -> None:
    """A tree of sub-agents deeper than the top agent's `maxDepth` is refused."""
    limit = DEFAULT_MAX_DEPTH if spec.max_depth is None else spec.max_depth
    if spec.depth > limit:
        raise InvalidAgentFile(
            f"{source}: subAgents: sub-agents nest {spec.depth} levels deep, more than maxDepth ({limit}); "
            "flatten the tree or raise maxDepth",
            file=source,
        )


def _with_sub_agents(
    data: dict[str, Any], source: str, chain: tuple[str, ...]
) -> tuple[dict[str, Any], list[AgentFile]]:
    """`data` with each sub-agent (a path relative to the file, or an agent object) read and
    validated in place, and the sub-agents read. An agent that is its own ancestor (by file or
    slug) is refused."""
    key = "subAgents" if data.get("subAgents") else "extraAgents"
    entries = data.get(key)
    if not isinstance(entries, list):
        raise InvalidAgentFile(f'{source}: {key}: a list of agent file paths (write "{key}": ["helper.json"])')
    here = (*chain, str(data.get("slug")))
    subs: list[AgentFile] = []
    for i, entry in enumerate(entries):
        where = f"{source}: {key}[{i}]"
        if isinstance(entry, str):
            if not data.get("baseDir"):
                raise InvalidAgentFile(
                    f"{where}: a path needs an agent file to be relative to; give the sub-agent as an agent object"
                )
            path = Path(data["baseDir"]) / entry
            marker = f"file:{path.resolve()}"
            if marker in here:
                raise InvalidAgentFile(f"{where}: {entry} is an agent that (transitively) delegates to itself")
            sub = read_agent_file(path, _chain=(*here, marker))
        elif isinstance(entry, dict):
            sub = read_agent(entry, where, base_dir=data.get("baseDir"), _chain=here)
        else:
            raise InvalidAgentFile(f"{where}: give the path of an agent file")
        if sub.declared.slug in here:
            raise InvalidAgentFile(f"{where}: agent {sub.declared.slug!r} (transitively) delegates to itself")
        subs.append(sub)
    rest = {k: v for k, v in data.items() if k not in ("subAgents", "extraAgents")}
    return {**rest, "subAgents": [_dumped(sub.declared) for sub in subs]}, subs


def _toolboxes(data: dict[str, Any], source: str) -> list[Toolbox]:
    """The file's toolboxes (agents-exe's `toolDirectory` and `bashToolboxes` folded in)."""
    try:
        boxes = normalise_toolboxes(data).get("toolboxes") or []
        return [Toolbox.model_validate(b) for b in boxes]
    except (ValidationError, AttributeError, TypeError) as exc:
        raise InvalidAgentFile(
            f'{source}: toolboxes: {exc} (write "toolboxes": ["tools/"] or [{{"path": "tools/", "prefix": "bash_"}}])',
            file=source,
        ) from None


def _servers(data: dict[str, Any], source: str) -> list[McpServer]:
    raw = data.get("mcpServers")
    if not isinstance(raw, list):
        raise InvalidAgentFile(
            f'{source}: mcpServers: give a list, e.g. [{{"name": "files", "command": ["python3", "server.py"]}}]',
            file=source,
        )
    servers = []
    for i, entry in enumerate(raw):
        try:
            servers.append(McpServer.model_validate(entry))
        except ValidationError as exc:
            message = describe_validation_error(f"{source}: mcpServers[{i}]", exc).replace(": (top level)", "")
            raise InvalidAgentFile(message, file=source) from None
    return servers


def read_agent_file(path: str | Path, _chain: tuple[str, ...] = ()) -> AgentFile:
    """Read and validate an agent file; raises `InvalidAgentFile` naming the file, field and fix."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidAgentFile(f"{p}: no such file (check the --agent-file path)", file=str(p)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidAgentFile(f"{p}: cannot read it: {exc}", file=str(p)) from None
    try:
        data = load_json(raw)
    except json.JSONDecodeError as exc:
        raise InvalidAgentFile(
            f"{p}: line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg} (fix the JSON syntax)",
            file=str(p),
        ) from None
    except UnusableJson as exc:
        raise InvalidAgentFile(f"{p}: (top level): not a usable agent file: {exc}", file=str(p)) from None
    read = read_agent(data, str(p), base_dir=str(p.resolve().parent), _chain=_chain or (f"file:{p.resolve()}",))
    if not _chain:
        _check_nesting(read.declared, str(p))
    return read
