"""MCP tool servers in the agent file (`mcpServers`) and the reference an MCP tool keeps.

A server is started by `command` (stdio) or reached at `url` (Streamable HTTP); an entry here is
data only. Its tools are listed when the agent is resolved (`celery_agents.tools.resolve`) and join
the agent's tools as `mcp__<server>__<tool>`, each carrying an `McpToolRef` back to its server, so
workers call them without listing again.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: how the providers let a tool be named
_TOOL_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]")
_TOOL_NAME_MAX = 64
#: the longest name a server may give a tool (the MCP specification's 1-128 characters)
MCP_TOOL_NAME_MAX = 128


class McpServer(BaseModel):
    """One `mcpServers` entry: `command` (stdio, with `env`) or `url` (with `headersEnv`).

    `command` may also be written as a string with `args` (the Claude Desktop form). `env` values
    are given to the server as written (they are stored with the agent: keep secrets out of them);
    `passEnv` names variables whose values the server gets from the environment of the process that
    starts it (never stored); `headersEnv` maps an HTTP header to the variable holding its value,
    read where the call runs.
    `network`: a runIsolated call of this server may reach the network (it is cut by default).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, defer_build=True)

    name: str
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    pass_env: list[str] = Field(default_factory=list, alias="passEnv")
    url: str | None = None
    headers_env: dict[str, str] = Field(default_factory=dict, alias="headersEnv")
    network: bool = False

    @model_validator(mode="before")
    @classmethod
    def _command_and_args(cls, value: Any) -> Any:
        return _command_list(value)

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not _SERVER_NAME.match(value):
            raise ValueError("a server name is 1-32 letters, digits, '_' or '-' (its tools are mcp__<name>__<tool>)")
        return value

    @field_validator("command")
    @classmethod
    def _command_shape(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(isinstance(a, str) and a for a in value)):
            raise ValueError('a command is a non-empty list of arguments, e.g. ["python3", "server.py"]')
        return value

    @field_validator("pass_env")
    @classmethod
    def _pass_env_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _ENV_NAME.match(name):
                raise ValueError(f"passEnv names environment variables; {name!r} is not one")
            if name.upper().startswith("AGENTS_"):
                raise ValueError(f"{name} is a setting of the worker, never given to a server (remove it)")
        return value

    @field_validator("url")
    @classmethod
    def _url_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^\s/]+", value):
            raise ValueError('a server url is http:// or https://, e.g. "http://127.0.0.1:8931/mcp"')
        return value

    @field_validator("headers_env")
    @classmethod
    def _headers_shape(cls, value: dict[str, str]) -> dict[str, str]:
        for header, variable in value.items():
            if not _HEADER_NAME.match(header) or not _ENV_NAME.match(variable):
                raise ValueError(
                    f"headersEnv maps a header to the environment variable holding its value "
                    f'(e.g. {{"Authorization": "SEARCH_TOKEN"}}); {header!r}: {variable!r} is not that'
                )
            if variable.upper().startswith("AGENTS_"):
                raise ValueError(f"headersEnv names {variable}, a setting of the worker, never sent to a server")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"server {self.name!r} needs exactly one of command (stdio) or url (Streamable HTTP)")
        if self.url is not None and (self.env or self.pass_env):
            raise ValueError(
                f"server {self.name!r}: env and passEnv are for stdio servers; an HTTP server takes headersEnv"
            )
        if self.command is not None and self.headers_env:
            raise ValueError(f"server {self.name!r}: headersEnv is for HTTP servers; a stdio server takes env")
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"

    def identity(self, base_dir: str | None) -> str:
        """What makes two entries the same running server (its name aside): one per process each."""
        body = self.model_dump(mode="json", exclude={"name", "network"})
        body["base_dir"] = base_dir if self.command is not None else None
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


class McpToolRef(BaseModel):
    """Which server answers a tool, and the tool's own name there."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    server: str
    tool: str


def mcp_tool_name(server: str, tool: str) -> str:
    """`mcp__<server>__<tool>`, in the characters and length the providers accept (a name cut or
    changed gets a short digest of the original, so two tools never collide)."""
    name = f"mcp__{server}__{tool}"
    safe = _TOOL_NAME_CHARS.sub("_", name)
    if safe == name and len(name) <= _TOOL_NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{safe[: _TOOL_NAME_MAX - 9]}_{digest}"


def normalise_servers(value: dict[str, Any]) -> dict[str, Any]:
    """`mcpServers` written the Claude Desktop way (an object keyed by name, `command` a string
    with `args`) as the list of entries with `command` lists."""
    servers = value.get("mcpServers")
    if isinstance(servers, dict):
        servers = [{"name": name, **spec} if isinstance(spec, dict) else spec for name, spec in servers.items()]
    if not isinstance(servers, list):
        return value
    return {**value, "mcpServers": [_command_list(s) for s in servers]}


def _command_list(server: Any) -> Any:
    if not isinstance(server, dict) or not isinstance(server.get("command"), str):
        return server
    server = dict(server)
    args = server.pop("args", None) or []
    server["command"] = [server["command"], *args] if isinstance(args, list) else server["command"]
    return server
