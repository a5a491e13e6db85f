"""The agent file: model, tools and per-tool policy, as pydantic models.

Field names are the agent file's own (camelCase). Reading a file into them is
`model.agent_file`; finding the tools it leaves to be found (toolboxes, MCP servers, python
signatures) is `celery_agents.tools.resolve`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from celery_agents.model.admission import PRIORITY_MAX, PRIORITY_MIN, check_limit_key
from celery_agents.model.budget import Budget, Pricing
from celery_agents.model.mcp import McpServer, McpToolRef, normalise_servers

DispositionTag = Literal["runSync", "runAsync", "runIsolated", "defer"]
#: where a dispatched call runs: a tools-queue worker, or the isolated queue's sandbox
Lane = Literal["runAsync", "runIsolated"]
DISPOSITION_TAGS: tuple[str, ...] = ("runSync", "runAsync", "runIsolated", "defer")
#: what implements a tool: each but `external` has its source in `celery_agents.tools.sources`
ToolKind = Literal["command", "python", "script", "mcp", "external"]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: model parameters that would choose the endpoint or the key behind `apiBase`/`apiKeyEnv`'s back
_ENDPOINT_PARAMS = ("api_key", "api_base", "base_url", "apiKey", "apiBase", "baseUrl")


def _key_variable(value: str | None) -> str | None:
    """`apiKeyEnv` names the variable holding a provider's key, never a worker setting."""
    if value is not None and value.upper().startswith("AGENTS_"):
        raise ValueError(
            f"apiKeyEnv names {value}, a setting of the worker: name the variable holding the provider's key"
        )
    return value


class _Spec(BaseModel):
    # defer_build: a schema is built on first use, so commands that read no agent file (`pending`,
    # `show`, `complete`) do not pay for building every agent-file schema when they start.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True, defer_build=True)


class Limits(_Spec):
    """Resource limits of a tool run; a field left out keeps the default (docs/tools.md).

    `outputBytes` caps what is kept of any run's output; the others bound a sandboxed
    (`runIsolated`) run through rlimits.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, defer_build=True)

    memory_mb: int | None = Field(default=None, alias="memoryMb", gt=0)
    cpu_seconds: int | None = Field(default=None, alias="cpuSeconds", gt=0)
    open_files: int | None = Field(default=None, alias="openFiles", ge=8)
    file_size_mb: int | None = Field(default=None, alias="fileSizeMb", gt=0)
    processes: int | None = Field(default=None, gt=0)
    output_bytes: int | None = Field(default=None, alias="outputBytes", gt=0)

    def over(self, base: Limits) -> Limits:
        """These limits where set, `base` elsewhere."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


class Disposition(_Spec):
    """How a tool call runs: written `"runSync"` or `{"tag": "runSync", ...}`.

    `timeoutSeconds` is the deadline of a deferred call, or the execution timeout of the others;
    `retries` (with `backoffSeconds`, doubled on each retry), `truncate` and `limits` decorate
    executed calls.
    """

    tag: DispositionTag
    reason: str | None = None
    timeout_seconds: float | None = Field(default=None, alias="timeoutSeconds", gt=0)
    retries: int | None = Field(default=None, ge=0, le=20)
    backoff_seconds: float | None = Field(default=None, alias="backoffSeconds", ge=0, le=600)
    truncate: int | None = Field(default=None, gt=0)
    limits: Limits | None = None
    #: runIsolated: whether the run keeps the network (None: the tool's `network`, cut by default)
    network: bool | None = None
    #: defer only: an approval gate. Approved, the call runs under this disposition (with its own
    #: decorators); rejected or expired, it never runs. None: the person supplies the result.
    then: Disposition | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"tag": value}
        return value

    @model_validator(mode="after")
    def _then_of_defer_only(self) -> Disposition:
        if self.then is not None:
            if self.tag != "defer":
                raise ValueError(f'"then" belongs to a defer disposition (an approval gate), not to {self.tag}')
            if self.then.tag == "defer" or self.then.then is not None:
                raise ValueError('"then" is runSync, runAsync or runIsolated: what runs once a person approves')
        return self

    @property
    def gate(self) -> bool:
        """An approval gate: deferred until a person decides, then run under `then`."""
        return self.then is not None

    def applied(self) -> Disposition:
        """The disposition a call runs under: `then` for an approved gate, else this one."""
        return self.then if self.then is not None else self


class PolicyRule(_Spec):
    """Calls of the tool named `tool` get `disposition`; a `tool` ending in `*` names every tool
    whose name starts with what comes before it (an exact rule beats such a prefix rule)."""

    tool: str
    disposition: Disposition
    #: a JSON Schema the call's arguments must validate against for the rule to apply
    when: dict[str, Any] | None = None

    @field_validator("when")
    @classmethod
    def _when_is_a_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_schema("when", value)
        return value

    @property
    def is_prefix(self) -> bool:
        return self.tool.endswith("*")

    def matches(self, tool_name: str) -> bool:
        if self.is_prefix:
            return tool_name.startswith(self.tool[:-1])
        return tool_name == self.tool

    def applies(self, tool_name: str, arguments: Any) -> bool:
        """The rule names the tool and, with `when`, the arguments validate against it."""
        if not self.matches(tool_name):
            return False
        if self.when is None:
            return True
        return bool(_when_validator(json.dumps(self.when, sort_keys=True)).is_valid(arguments))


def check_schema(name: str, value: dict[str, Any]) -> None:
    """A field of the agent file holding a JSON Schema: refused, naming where, unless it is one."""
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top level)"
        raise ValueError(f"{name} is not a valid JSON Schema at {where}: {exc.message}") from None


@functools.lru_cache(maxsize=256)
def _when_validator(schema: str) -> Any:
    """A compiled validator of a rule's `when` (specs are immutable: cached by its text)."""
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads(schema))


class ToolCallPolicy(_Spec):
    """`default` for every call no rule names; the first matching rule wins."""

    default: Disposition = Field(default_factory=lambda: Disposition(tag="runSync"))
    rules: list[PolicyRule] = Field(default_factory=list)


class ScriptArg(_Spec):
    """One argument of an agents-exe style executable, as its `describe` prints it.

    `mode` says how `run` receives it: `positional`, `dashdashspace` (`--name value`),
    `dashdashequal` (`--name=value`) or `stdin` (one line); `arity` is `single` or `optional`.
    """

    name: str
    description: str = ""
    type: str = "string"
    backing_type: str = "string"
    arity: Literal["single", "optional"] = "single"
    mode: Literal["positional", "dashdashspace", "dashdashequal", "stdin"] = "positional"


class ToolSpec(_Spec):
    """One tool the model may call: exactly one of `command`, `python`, `script`, `mcp`, `external`.

    `mcp` tools are not written by hand: they are listed from the agent's `mcpServers` when the
    agent is resolved (`celery_agents.tools.resolve`).

    `script` is an agents-exe style executable (`describe` / `run`); agents usually get such tools
    from a folder through `toolboxes` rather than writing them here. A `python` tool that declares
    no `parameters` gets the schema derived from the function's signature when the agent is
    resolved.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    command: list[str] | None = None
    python: str | None = None
    script: str | None = None
    external: bool = False
    #: the MCP server tool this tool calls
    mcp: McpToolRef | None = None
    #: how `run` of a `script` tool takes each argument (from its `describe`); none: JSON on stdin
    script_args: list[ScriptArg] | None = Field(default=None, alias="scriptArgs")
    #: the text answered when a `script` tool prints nothing
    empty_result: str | None = Field(default=None, alias="emptyResult")
    #: stdout of the tool is a file of this media type (e.g. "image/png"), not text
    output_media_type: str | None = Field(default=None, alias="outputMediaType")
    #: names of environment variables of the worker this tool's runs get (any disposition)
    env: list[str] = Field(default_factory=list)
    #: resource limits of this tool's runs (a disposition's `limits` override them)
    limits: Limits | None = None
    #: an isolated run keeps the network (it is cut by default; a policy rule's `network` wins)
    network: bool = False

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if name.upper().startswith("AGENTS_"):
                raise ValueError(f"{name} is a setting of the worker, never given to a tool (remove it from env)")
        return value

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not _TOOL_NAME.match(value):
            raise ValueError("a tool name is 1-64 letters, digits, '_' or '-' (the providers' rule)")
        return value

    @field_validator("command")
    @classmethod
    def _command_shape(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(isinstance(a, str) and a for a in value)):
            raise ValueError('a command is a non-empty list of arguments, e.g. ["python3", "tools/x.py"]')
        return value

    @field_validator("python")
    @classmethod
    def _python_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
            raise ValueError('a python tool is written "package.module:function"')
        return value

    @field_validator("parameters")
    @classmethod
    def _parameters_shape(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError('parameters is a JSON Schema whose "type" is "object"')
        check_schema("parameters", value)
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> ToolSpec:
        kinds = [
            k
            for k, v in (("command", self.command), ("python", self.python), ("script", self.script), ("mcp", self.mcp))
            if v
        ]
        kinds += ["external"] if self.external else []
        if len(kinds) != 1:
            raise ValueError(
                f"tool {self.name!r} needs exactly one of command, python, script, mcp or external: true "
                f"(found {', '.join(kinds) or 'none'})"
            )
        return self

    @property
    def kind(self) -> ToolKind:
        if self.mcp:
            return "mcp"
        if self.command:
            return "command"
        if self.python:
            return "python"
        if self.script:
            return "script"
        return "external"

    def openai_schema(self) -> dict[str, Any]:
        """The tool as the model sees it (OpenAI function-calling shape)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class Toolbox(_Spec):
    """A folder of agents-exe style executables (or one such executable), each a tool named
    `prefix` + the slug its `describe` prints. Written `"tools/"` or `{"path": "tools/", ...}`;
    `filter` keeps only file names containing it."""

    path: str
    prefix: str = "bash_"
    filter: str | None = Field(default=None, alias="basenameFilter")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"path": value}
        return value


def normalise_toolboxes(value: dict[str, Any]) -> dict[str, Any]:
    """agents-exe's `toolDirectory` and `bashToolboxes` (tagged FileSystemDirectory / SingleTool)
    folded into `toolboxes`."""
    if "toolDirectory" not in value and "bashToolboxes" not in value:
        return value
    value = dict(value)
    extra: list[Any] = []
    directory = value.pop("toolDirectory", None)
    if directory is not None:
        extra.append(directory)
    boxes = value.pop("bashToolboxes", None) or []
    for box in boxes if isinstance(boxes, list) else [boxes]:
        extra.append(box.get("contents") if isinstance(box, dict) and "tag" in box else box)
    value["toolboxes"] = [*(value.get("toolboxes") or []), *extra]
    return value


class FallbackModel(_Spec):
    """A model tried when the agent's own model fails: written `"anthropic/claude-…"` (litellm's
    environment defaults for that provider) or `{"model", "apiBase", "apiKeyEnv"}`."""

    model: str
    api_base: str | None = Field(default=None, alias="apiBase")
    api_key_env: str | None = Field(default=None, alias="apiKeyEnv")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"model": value}
        return value

    @field_validator("api_key_env")
    @classmethod
    def _api_key_env(cls, value: str | None) -> str | None:
        return _key_variable(value)


class AgentSpec(_Spec):
    """An agent file, validated. `base_dir` is the folder relative command paths resolve against.

    `toolboxes` (or agents-exe's `toolDirectory` / `bashToolboxes`) are described when the agent is
    resolved (`celery_agents.tools.resolve`): their tools join `tools`, so the stored agent names
    every tool. Validated with the context `{"unresolved": True}` (an agent file as written, by
    `model.agent_file`), a policy rule may name a tool its toolboxes or MCP servers are still to
    list.
    """

    slug: str
    model: str
    api_base: str | None = Field(default=None, alias="apiBase")
    api_key_env: str | None = Field(default=None, alias="apiKeyEnv")
    system_prompt: str | list[str] | None = Field(default=None, alias="systemPrompt")
    max_steps: int = Field(default=40, alias="maxSteps", ge=1, le=100_000)
    #: calls of one model response that run; the ones beyond are answered with an error result
    max_tool_calls_per_turn: int = Field(default=64, alias="maxToolCallsPerTurn", ge=1, le=10_000)
    tools: list[ToolSpec] = Field(default_factory=list)
    execution_mode: Literal["synchronous", "asynchronous"] | None = Field(default=None, alias="executionMode")
    tool_call_policy: ToolCallPolicy | None = Field(default=None, alias="toolCallPolicy")
    #: deadline of a deferred call unless its rule says otherwise
    defer_timeout_seconds: float = Field(default=86400.0, alias="deferTimeoutSeconds", gt=0)
    #: extra keyword arguments for the model call (temperature, max_tokens, ...)
    model_params: dict[str, Any] = Field(default_factory=dict, alias="modelParams")
    base_dir: str | None = Field(default=None, alias="baseDir")
    toolboxes: list[Toolbox] = Field(default_factory=list)
    #: models tried in order when `model` fails (after its own retries)
    fallback_models: list[FallbackModel] = Field(default_factory=list, alias="fallbackModels")
    #: `false`: the model's answer is asked for whole, not streamed (for a model that cannot
    #: stream); unset is on (None, so specs stored before the field keep their content hash)
    stream: bool | None = None
    #: MCP tool servers; their tools are listed into `tools` when the agent is resolved
    mcp_servers: list[McpServer] = Field(default_factory=list, alias="mcpServers")
    #: what the agent is for, told to a parent agent's model (its `prompt_agent_<slug>` tool)
    description: str | None = None
    #: agents this one may delegate to, each a child session (`subAgents`; `extraAgents` too):
    #: paths in the file, the loaded agents once loaded
    sub_agents: list[AgentSpec] | None = Field(default=None, alias="subAgents")
    #: how deep sub-agents may nest below this agent (default 4), checked when the file is read
    max_depth: int | None = Field(default=None, alias="maxDepth", ge=0, le=64)
    #: what a session of this agent may spend, its sub-agents included
    budget: Budget | None = None
    #: what its model calls cost (per million tokens), instead of litellm's price list
    pricing: Pricing | None = None
    #: a fleet limit's KEY its model calls count against too, besides its model's (`agents limits`)
    limit_key: str | None = Field(default=None, alias="limitKey")
    #: 0 (lowest) to 9: steps of higher-priority sessions are taken first; none given: 5, or a
    #: sub-agent's parent session's
    priority: int | None = Field(default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    #: fields of an agents-exe file that were accepted and not used (for a warning)
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """Fields of the file, written as paths, that agents-exe knows and celery-agents ignores."""
        return self._ignored

    @model_validator(mode="before")
    @classmethod
    def _policy_alias(cls, value: Any) -> Any:
        if isinstance(value, dict) and "toolCallPolicyConfig" in value:
            if "toolCallPolicy" in value:
                raise ValueError("give toolCallPolicy or toolCallPolicyConfig, not both")
            value = dict(value)
            value["toolCallPolicy"] = value.pop("toolCallPolicyConfig")
        return value

    @model_validator(mode="before")
    @classmethod
    def _sub_agents_alias(cls, value: Any) -> Any:
        if isinstance(value, dict) and "extraAgents" in value:
            value = dict(value)
            extra = value.pop("extraAgents")
            if value.get("subAgents") and extra:
                raise ValueError("give subAgents or extraAgents, not both")
            value["subAgents"] = value.get("subAgents") or extra
        return value

    @model_validator(mode="before")
    @classmethod
    def _toolbox_aliases(cls, value: Any) -> Any:
        return normalise_toolboxes(value) if isinstance(value, dict) else value

    @model_validator(mode="before")
    @classmethod
    def _server_map(cls, value: Any) -> Any:
        return normalise_servers(value) if isinstance(value, dict) else value

    @field_validator("slug")
    @classmethod
    def _slug_shape(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", value):
            raise ValueError("a slug is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @field_validator("api_key_env")
    @classmethod
    def _api_key_env(cls, value: str | None) -> str | None:
        return _key_variable(value)

    @field_validator("limit_key")
    @classmethod
    def _limit_key(cls, value: str | None) -> str | None:
        return None if value is None else check_limit_key(value)

    @field_validator("model_params")
    @classmethod
    def _model_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        named = [k for k in _ENDPOINT_PARAMS if k in value]
        if named:
            raise ValueError(
                f"modelParams may not set {', '.join(named)}: the endpoint is apiBase and the key is named by apiKeyEnv"
            )
        return value

    @field_validator("model")
    @classmethod
    def _model_shape(cls, value: str) -> str:
        if not value.strip():
            raise ValueError('name the model, e.g. "openai/gpt-4o-mini"')
        return value

    @model_validator(mode="after")
    def _check_tools(self, info: ValidationInfo) -> AgentSpec:
        names = [t.name for t in self.tools] + list(self.sub_agent_tools)
        if len(self.sub_agent_tools) < len(self.sub_agents or []):
            raise ValueError("subAgents: two sub-agents have the same slug; each needs its own")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(dupes)}")
        servers = [s.name for s in self.mcp_servers]
        repeated = sorted({n for n in servers if servers.count(n) > 1})
        if repeated:
            raise ValueError(f"mcpServers names must be unique; repeated: {', '.join(repeated)}")
        for tool in self.tools:
            if tool.mcp is not None and tool.mcp.server not in servers:
                raise ValueError(f"tool {tool.name!r} calls MCP server {tool.mcp.server!r}, which mcpServers lacks")
        # Before its toolboxes are described and its servers listed, a rule may name a tool to come.
        to_come = bool(info.context and info.context.get("unresolved")) and bool(self.toolboxes or self.mcp_servers)
        if self.tool_call_policy and not to_come:
            for i, rule in enumerate(self.tool_call_policy.rules):
                if not any(rule.matches(n) for n in names):
                    what = "matches no tool" if rule.is_prefix else "names a tool"
                    raise ValueError(
                        f"toolCallPolicy.rules[{i}] {what} {rule.tool!r}, which the agent does not declare "
                        f"(declared: {', '.join(names) or 'none'}); fix the name or add the tool"
                    )
        return self

    @property
    def mode(self) -> Literal["synchronous", "asynchronous"]:
        """The execution mode; a file with a policy but no mode means asynchronous."""
        if self.execution_mode:
            return self.execution_mode
        return "asynchronous" if self.tool_call_policy else "synchronous"

    @property
    def system_prompt_text(self) -> str | None:
        if isinstance(self.system_prompt, list):
            return "\n".join(self.system_prompt)
        return self.system_prompt

    def mcp_server(self, name: str) -> McpServer | None:
        return next((s for s in self.mcp_servers if s.name == name), None)

    @property
    def streams(self) -> bool:
        """The model's answer streams (live output) unless the file says `"stream": false`."""
        return self.stream is not False

    @property
    def sub_agent_tools(self) -> dict[str, AgentSpec]:
        """The sub-agents by the name of the tool the model calls them with."""
        return {sub_agent_tool_name(a.slug): a for a in self.sub_agents or []}

    def sub_agent(self, tool_name: str) -> AgentSpec | None:
        return self.sub_agent_tools.get(tool_name) if self.sub_agents else None

    def tool_schemas(self) -> list[dict[str, Any]]:
        """Every tool offered to the model (OpenAI shape): the declared tools, then one per sub-agent."""
        schemas = [t.openai_schema() for t in self.tools]
        for name, sub in self.sub_agent_tools.items():
            about = sub.description or f"Ask the agent {sub.slug!r} to do a task; its final answer is the result."
            schemas.append(
                {"type": "function", "function": {"name": name, "description": about, "parameters": _PROMPT}}
            )
        return schemas

    @property
    def depth(self) -> int:
        """How many levels of sub-agents nest below this agent."""
        return 1 + max((a.depth for a in self.sub_agents), default=-1) if self.sub_agents else 0

    def tool(self, name: str) -> ToolSpec | None:
        for t in self.tools:
            if t.name == name:
                return t
        return None

    def no_tool_named(self, name: str) -> str:
        """What the model is told when it calls a tool this agent does not have."""
        names = ", ".join([t.name for t in self.tools] + list(self.sub_agent_tools)) or "none"
        return f"there is no tool named {name!r}; the tools are: {names}"

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), the form stored in Redis and hashed."""
        return json.dumps(
            self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=True, separators=(",", ":")
        )

    def content_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]

    @classmethod
    def from_json(cls, raw: str | bytes) -> AgentSpec:
        return cls.model_validate_json(raw)


_PROMPT: dict[str, Any] = {
    "type": "object",
    "properties": {"prompt": {"type": "string", "description": "the task, as a prompt for the agent"}},
    "required": ["prompt"],
}


def sub_agent_tool_name(slug: str) -> str:
    """`prompt_agent_<slug>`, in the characters a tool name may hold."""
    return "prompt_agent_" + re.sub(r"[^A-Za-z0-9_-]", "_", slug)[:51]


def agent_json_schema() -> dict[str, Any]:
    """The agent file's JSON Schema (field names as written in the file)."""
    schema = AgentSpec.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    if "$ref" in schema:  # the agent nests (subAgents): its schema is a definition, referred to
        schema = {**defs[schema["$ref"].rsplit("/", 1)[-1]], "$defs": defs}
    if "subAgents" in schema.get("properties", {}):
        # In a file, a sub-agent is the path of its agent file (or an agent object).
        item = {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/AgentSpec"}]}
        schema["properties"]["subAgents"] = {"type": "array", "items": item, "title": "Subagents"}
    # Dispositions and fallback models may also be written as a bare string.
    if "Disposition" in defs:
        defs["Disposition"] = {"anyOf": [{"type": "string", "enum": list(DISPOSITION_TAGS)}, defs["Disposition"]]}
    if "FallbackModel" in defs:
        defs["FallbackModel"] = {"anyOf": [{"type": "string"}, defs["FallbackModel"]]}
    return schema


def arguments_not_an_object(tool: str) -> str:
    """What the model is told when a call's arguments are JSON but not an object."""
    return f"the arguments of {tool} must be a JSON object"
