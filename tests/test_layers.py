"""The layers of `celery_agents`, read from its imports (docs/architecture.md, "Layers").

Every import statement of every module counts: at the top, inside a function (imported late),
or under `TYPE_CHECKING`, since each says what the module depends on. `IMPORT_RULES` is the table
of what a package must not import; `CIRCLE_EXCEPTIONS` the import edges left out of the check
that no import circle exists. A rule of another kind (an attribute reached, a call made) gets a
table of its own beside them, read from the same `MODULES`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "celery_agents"


@dataclass(frozen=True)
class Import:
    """One module a statement imports: its full dotted name, and the line of the statement."""

    target: str
    line: int


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: tuple[Import, ...]


def _name_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Module]:
    trees = {_name_of(p): (p, ast.parse(p.read_text(encoding="utf-8"), str(p))) for p in PACKAGE.rglob("*.py")}
    out = {}
    for name, (path, tree) in trees.items():
        found: list[Import] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [Import(alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, path, node)
                for alias in node.names:
                    # `from a import b` imports the module a.b when there is one, else a name of a.
                    sub = f"{base}.{alias.name}"
                    found.append(Import(sub if sub in trees else base, node.lineno))
        out[name] = Module(name, path, tree, tuple(found))
    return out


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


MODULES = _modules()


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


#: the one module besides the store that imports redis-py: it patches kombu's Redis transport,
#: the broker's own connection, raising redis-py's connection error there for kombu to handle
REDIS_BROKER_PATCH = "celery_agents.tasks.broker"
#: and the import of redis-py itself, outside the store package so that a command that reads and
#: ends can load redis-py lean before the store's modules import it: it uses none of its API
REDIS_IMPORT = "celery_agents.redis_import"


@dataclass(frozen=True)
class ImportRule:
    """Modules in `package` import nothing in `forbidden` (a package or module, ours or not), but
    those in `exempt`."""

    package: str
    forbidden: str
    why: str
    exempt: tuple[str, ...] = ()


IMPORT_RULES = (
    ImportRule(
        "celery_agents.model",
        "celery_agents.tools",
        "model is data: reading an agent file imports no tool code, runs no process, opens no connection",
    ),
    ImportRule(
        "celery_agents.tools",
        "celery_agents.scheduler",
        "tools execute calls; what a call gets is the spec's (model), not the state machine's",
    ),
    ImportRule("celery_agents.web", "celery_agents.cli", "front doors share the Client, not each other's code"),
    *(
        ImportRule("celery_agents.model", outside, "model is data: it connects nowhere and calls no model")
        for outside in ("redis", "celery", "kombu", "litellm")
    ),
    ImportRule(
        "celery_agents",
        "redis",
        "only the store talks to Redis: nothing above it handles redis-py or its errors",
        exempt=("celery_agents.store", REDIS_BROKER_PATCH, REDIS_IMPORT),
    ),
    *(
        ImportRule(package, "celery_agents.store", "front doors reach Redis through the Client only")
        for package in ("celery_agents.cli", "celery_agents.web", "celery_agents.mcp_server")
    ),
)

#: Celery's own circle: the app imports the task modules to register them, each imports the app
#: to declare its tasks (`tasks/celery_app.py`, last line)
CIRCLE_EXCEPTIONS = frozenset(
    ("celery_agents.tasks.celery_app", f"celery_agents.tasks.{name}")
    for name in ("calls", "mcp_servers", "services", "step")
)


def test_the_rules_see_the_package() -> None:
    """The reading above finds the modules and imports the rules are about (else they pass for
    nothing)."""
    assert {"celery_agents.model.agent", "celery_agents.tools.executor", "celery_agents.web.api"} <= set(MODULES)
    imported = {i.target for i in MODULES["celery_agents.tools.executor"].imports}
    assert "celery_agents.model" in imported and "celery_agents.tools.sandbox" in imported


@pytest.mark.parametrize("rule", IMPORT_RULES, ids=lambda r: f"{r.package}-not-{r.forbidden}")
def test_a_package_does_not_import_what_its_layer_forbids(rule: ImportRule) -> None:
    offending = [
        f"{m.path.relative_to(PACKAGE.parent)}:{i.line} imports {i.target}"
        for m in MODULES.values()
        if within(m.name, rule.package) and not any(within(m.name, e) for e in rule.exempt)
        for i in m.imports
        if within(i.target, rule.forbidden)
    ]
    assert not offending, f"{rule.why}:\n" + "\n".join(offending)


def _graph() -> dict[str, set[str]]:
    return {
        m.name: {i.target for i in m.imports if i.target in MODULES and i.target != m.name}
        - {b for a, b in CIRCLE_EXCEPTIONS if a == m.name}
        for m in MODULES.values()
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as a path around it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(_path_around(sorted(group), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _path_around(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle through the group's first module, for the message."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return group


def test_no_import_circle_but_celerys_app_and_its_tasks() -> None:
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]
    with_celery = {a: set(b) for a, b in _graph().items()}
    for a, b in CIRCLE_EXCEPTIONS:
        with_celery[a].add(b)
    assert _circles(with_celery), "Celery's app and tasks do import each other"
