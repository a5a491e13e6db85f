"""Python tools: loading `"module:function"`, the JSON Schema of its signature, binding arguments.

A python tool that declares no `parameters` is described to the model by its signature; whatever
the schema, the arguments are bound through a pydantic model of the signature, so a value of the
wrong type becomes a message the model can act on instead of an exception inside the tool.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

log = logging.getLogger(__name__)


class BadArguments(Exception):
    """The arguments do not fit the function; the message says what to send instead."""


_path_lock = threading.Lock()
_stdout_lock = threading.Lock()


def load_function(spec: str, folder: str | None = None) -> Callable[..., Any]:
    """`"package.module:function"` → the function (ImportError / AttributeError when absent).

    Where the module is found is one rule for every disposition: the interpreter's own import
    path first (installed packages), then `folder`, the agent file's folder (a runIsolated child
    gets the same path in the same order). In a worker process a module is imported once, so two
    agents' tool modules need different names."""
    if folder:
        _append_to_path(folder)
    module_name, _, func_name = spec.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    if not callable(func):
        raise AttributeError(f"{spec} is not a function")
    return func  # type: ignore[no-any-return]


def _append_to_path(folder: str) -> None:
    with _path_lock:
        if folder not in sys.path and os.path.isdir(folder):
            sys.path.append(folder)


@lru_cache(maxsize=512)
def signature_model(func: Callable[..., Any]) -> type[BaseModel]:
    """A pydantic model whose fields are the function's keyword-callable parameters."""
    fields: dict[str, Any] = {}
    extra = "forbid"
    try:
        parameters = inspect.signature(func, eval_str=True).parameters
    except (NameError, TypeError, SyntaxError):  # annotations that cannot be evaluated stay strings
        parameters = inspect.signature(func).parameters
    for name, param in parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = "allow"
            continue
        if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise TypeError(f"parameter {name!r} cannot be given by name; a python tool takes keyword arguments")
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        # pydantic refuses field names starting with "_": keep the name as the alias.
        attr = name if not name.startswith("_") else f"p{name}"
        fields[attr] = (annotation, Field(default, alias=name))
    config = ConfigDict(extra=extra, arbitrary_types_allowed=True, populate_by_name=True)  # type: ignore[typeddict-item]
    return create_model(f"{getattr(func, '__name__', 'tool')}_arguments", __config__=config, **fields)


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title" or not isinstance(v, str)}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def schema_of(func: Callable[..., Any]) -> dict[str, Any]:
    """The JSON Schema of the function's arguments (pydantic's, without generated titles)."""
    schema = signature_model(func).model_json_schema(by_alias=True)
    defs = schema.pop("$defs", None)
    schema = _strip_titles(schema)
    if defs:
        schema["$defs"] = defs
    schema.setdefault("properties", {})
    return schema  # type: ignore[no-any-return]


def describe_function(spec: str, folder: str | None = None) -> tuple[dict[str, Any], str] | None:
    """(schema, first paragraph of the docstring) of a python tool; None when it cannot be loaded
    here (the agent keeps an empty schema and the worker binds by signature at run time). What
    its module prints as it is imported goes to stderr: stdout is the command's output."""
    try:
        with _stdout_to_stderr():
            func = load_function(spec, folder)
        schema = schema_of(func)
    except Exception as exc:  # an unimportable or unusual function must not refuse the file
        log.warning("python tool %s: no schema derived from its signature (%s); declare parameters", spec, exc)
        return None
    doc = inspect.getdoc(func) or ""
    return schema, doc.split("\n\n", 1)[0].strip()


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 (and `sys.stdout`, flushed) goes to stderr meanwhile, so that a module's
    `print` or `os.write(1, …)` at import cannot slip into a `--json` document."""
    with _stdout_lock:  # one at a time: the descriptor is the process's
        saved = None
        with contextlib.suppress(OSError, ValueError, AttributeError):  # else no stdout to protect
            sys.stdout.flush()
            saved = os.dup(1)
            try:
                os.dup2(2, 1)
            except OSError:
                os.close(saved)
                saved = None
        try:
            yield
        finally:
            if saved is not None:
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)


def bind_arguments(func: Callable[..., Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments to call `func` with, converted to its annotations; `BadArguments`
    saying what is wrong otherwise."""
    model = signature_model(func)
    try:
        bound = model.model_validate(arguments)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            where = ".".join(str(p) for p in err.get("loc", ())) or "(arguments)"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        raise BadArguments("; ".join(problems)) from None
    kwargs = {(info.alias or name): getattr(bound, name) for name, info in type(bound).model_fields.items()}
    kwargs.update(bound.model_extra or {})
    return kwargs
