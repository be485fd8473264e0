"""The fence around the package's layout (docs/code-map.md): every module imports only from
layers below it, never sideways between mechanism rooms, and no import cycle exists.

The test reads every ``import`` in the package with ``ast``, function-local and
``TYPE_CHECKING`` ones included, because an import hidden in a function is still an edge a
reader has to follow. ``ALLOWED`` lists the edges that break the rule today; each move of the
layout deletes entries, and an entry that no longer exists fails the test so that the list can
only shrink. When it is empty the layout is the one the code map describes.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import django_fair_jobs

PACKAGE = Path(django_fair_jobs.__file__).parent
NAME = "django_fair_jobs"

LAYERS: dict[str, int] = {
    # L0: settings, errors, names, the database helpers; they import nothing of the package
    # above them.
    "conf": 0,
    "errors": 0,
    "headers": 0,
    "validation": 0,
    "routing": 0,
    "broker": 0,
    "db": 0,
    "events": 0,
    "sql": 0,
    # L1: tenants, the schema, the one place a job is re-sent.
    "tenants": 1,
    "models": 1,
    "dispatch.models": 1,
    "planner.models": 1,
    "messages": 1,
    # L2: shared by several rooms.
    "caps": 2,
    "decisions": 2,
    "identity": 2,
    "leases": 2,
    "waits": 2,
    # L3: the mechanism rooms (see ROOMS); no room imports another.
    "slots": 3,
    "reroute": 3,
    "planner": 3,
    "queue_limits": 3,
    "dispatch": 3,
    # L4: the two pipelines that combine rooms.
    "admission": 4,
    "publishing": 4,
    # L5: the task classes.
    "task": 5,
    "plain_tasks": 5,
    "tasks": 5,
    # L6: what runs the rest and shows it; may import anything below.
    "maintenance": 6,
    "apps": 6,
    "signals": 6,
    "checks": 6,
    "status": 6,
    "explanations": 6,
    "backlog": 6,
    "metrics": 6,
    "admin": 6,
    "management": 6,
    "": 6,  # the package itself: FairTask and explain, imported lazily
}
"""Each module's layer, by its dotted name under the package (a package's submodules take
the package's layer unless listed themselves)."""

ROOMS = {"slots", "reroute", "planner", "queue_limits", "dispatch"}
"""The mechanism rooms of layer 3. A room's own modules may import each other."""

ALLOWED: set[tuple[str, str]] = set()
"""Edges that go up a layer or sideways between rooms, allowed while the package moved to
its layout. Empty: none is allowed. Never add one; move the code it needs down instead."""


ALLOWED_CYCLES: list[list[str]] = []
"""Cycles among modules of one layer. Empty: none is allowed."""


def module_name(path: Path) -> str:
    """The dotted name of ``path`` under the package ('' for the package itself)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package but its migrations, by dotted name."""
    return {
        module_name(path): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "migrations" not in path.relative_to(PACKAGE).parts
    }


def imports_of(source: str, name: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The package's modules that the module ``name`` imports anywhere in ``source``, as
    dotted names in ``known``; ``from package import module`` counts as importing the module."""
    known = set(known)
    here = name.split(".") if name else []
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        if dotted != NAME and not dotted.startswith(NAME + "."):
            return None
        rest = dotted[len(NAME) + 1 :]
        while rest and rest not in known:
            rest = rest.rpartition(".")[0]
        return rest

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([NAME, *base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = resolve(target)
            if resolved is not None and resolved != name:
                found.add(resolved)
    return found


def import_graph() -> dict[str, set[str]]:
    """The package's import graph: module -> the modules it imports."""
    modules = package_modules()
    return {
        name: imports_of(
            path.read_text(encoding="utf-8"), name, path.name == "__init__.py", modules
        )
        for name, path in modules.items()
    }


def layer_of(module: str) -> int:
    """The layer of ``module``: its own entry, else its package's."""
    probe = module
    while probe not in LAYERS:
        if not probe:
            raise KeyError(module)
        probe = probe.rpartition(".")[0]
    return LAYERS[probe]


def room_of(module: str) -> str | None:
    """The mechanism room ``module`` belongs to, or None outside the rooms."""
    top = module.split(".")[0]
    return top if top in ROOMS and layer_of(module) == 3 else None


def breaks_layering(source: str, target: str) -> bool:
    """Whether the edge ``source -> target`` goes up a layer or sideways between rooms."""
    if room_of(source) is not None and room_of(source) == room_of(target):
        # Inside one room its package imports its parts, never the reverse.
        return target == room_of(target) and source != target
    if layer_of(target) > layer_of(source):
        return True
    return layer_of(target) == layer_of(source) == 3


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of two or more
    modules (Tarjan's algorithm, iterative so a deep graph cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer() -> None:
    missing = []
    for module in package_modules():
        try:
            layer_of(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_imports_go_only_down__except_the_allowlist() -> None:
    graph = import_graph()
    breaking = {
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if breaks_layering(source, target)
    }
    new = sorted(breaking - ALLOWED)
    assert not new, (
        f"these imports go up a layer or sideways between rooms: {new}. Move the code they "
        "need down a layer (docs/code-map.md says where), or import it from a lower module."
    )
    gone = sorted(ALLOWED - breaking)
    assert not gone, f"these edges are gone: delete them from ALLOWED: {gone}"


def test_no_import_cycle__outside_the_allowlist() -> None:
    graph = import_graph()
    # Without the allowlisted edges the layering rules cycles out, except among modules of
    # one layer; those must not form one either.
    pruned = {
        source: {target for target in targets if (source, target) not in ALLOWED}
        for source, targets in graph.items()
    }
    assert cycles(pruned) == ALLOWED_CYCLES


def test_task_and_stores__import_before_django_is_set_up() -> None:
    # A project's Celery module may import its tasks (and so FairTask) before
    # django.setup(): the rooms import their stores at the top, so a store must import the
    # models only inside its functions. A fresh interpreter with no settings at all.
    code = (
        "import django_fair_jobs.task, django_fair_jobs.slots.store, "
        "django_fair_jobs.queue_limits.store, django_fair_jobs.reroute.store, "
        "django_fair_jobs.planner.store, django_fair_jobs.leases.store, "
        "django_fair_jobs.identity\n"
        "print('imported')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "imported", done.stderr


def test_fence__sees_function_local_relative_and_package_imports() -> None:
    source = (
        "from django_fair_jobs import slots\n"
        "from . import conf\n"
        "if TYPE_CHECKING:\n    from django_fair_jobs.task import FairTask\n"
        "def f():\n    from django_fair_jobs.planner import run\n    import django_fair_jobs.db\n"
    )
    known = {"slots", "conf", "task", "planner", "db", "reroute"}
    assert imports_of(source, "reroute", False, known) == {"slots", "conf", "task", "planner", "db"}
    assert imports_of("from .models import X\n", "dispatch.store", False, {"dispatch.models"}) == {
        "dispatch.models"
    }


@pytest.mark.parametrize(
    ("source", "target", "breaks"),
    [
        ("slots", "conf", False),  # down
        ("slots", "task", True),  # up
        ("slots", "queue_limits", True),  # sideways between rooms
        ("dispatch.store", "dispatch.models", False),  # inside one room (models is L1 anyway)
        ("admission", "publishing", False),  # one layer, not rooms: the cycle test guards it
        ("admin", "slots", False),
    ],
)
def test_breaks_layering__up_and_sideways_only(source: str, target: str, breaks: bool) -> None:
    assert breaks_layering(source, target) is breaks


def test_cycles__finds_a_cycle_and_only_real_ones() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_is_fair__a_fair_task_is__a_plain_task_is_not() -> None:
    from celery import Task, shared_task

    from django_fair_jobs import messages
    from django_fair_jobs.task import FairTask

    @shared_task(name="tests.architecture.plain")
    def plain() -> None:
        """A plain Celery task."""

    @shared_task(base=FairTask, name="tests.architecture.fair")
    def fair() -> None:
        """A fair task."""

    assert messages.is_fair(fair) and isinstance(fair, FairTask)
    assert not messages.is_fair(plain) and isinstance(plain, Task)


def test_registration__starts_the_heartbeat__though_the_rooms_never_import_maintenance() -> None:
    # identity (layer 2) cannot import maintenance (layer 6); maintenance hooks itself in
    # when it is imported, which the app's ready() must guarantee before any job runs. A
    # fresh interpreter, since this one may have imported maintenance already.
    code = (
        "import django; django.setup()\n"
        "from django_fair_jobs import identity\n"
        "print(sorted(h.__module__ + '.' + h.__name__ for h in identity._on_register))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    ).stdout  # fmt: skip
    assert "django_fair_jobs.maintenance.threads._start_threads" in out, out


RETIRED_VERBS = re.compile(
    r"give_back|gives? back|given back|take_back|takes? back|rewake|rewoken|re-wake|re-queue"
    r"|forget_task"
    r"|forget_parked|dispatch\.forget",
    re.IGNORECASE,
)
"""Synonyms of a job's steps that one verb each replaced (docs/concepts.md, "One verb per
step"): release, requeue and drop."""


def test_one_verb_per_step__retired_synonyms_appear_nowhere() -> None:
    root = PACKAGE.parent
    texts = [
        path
        for pattern in (
            "django_fair_jobs/**/*.py",
            "django_fair_jobs/**/*.sql",
            "django_fair_jobs/**/*.html",
            "docs/*.md",
            "README.md",
        )
        for path in root.glob(pattern)
        if path.name != "changelog.md" and "migrations" not in path.parts
    ]
    assert len(texts) > 50
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in texts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if RETIRED_VERBS.search(line)
    ]
    assert not found, "use the step's verb (docs/concepts.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "room", ["slots", "queue_limits", "reroute", "planner", "leases", "maintenance"]
)
def test_store_contract__the_orm_store_has_the_postgresql_stores_functions(room: str) -> None:
    import importlib
    import inspect

    sql = importlib.import_module(f"{NAME}.{room}.store")
    orm = importlib.import_module(f"{NAME}.{room}.store_orm")
    steps = {
        name: value
        for name, value in vars(orm).items()
        if inspect.isfunction(value) and value.__module__ == orm.__name__ and name[0] != "_"
    }
    assert steps, f"{orm.__name__} implements no step"
    handed_over = 0
    for name, step in steps.items():
        mine = getattr(sql, name)
        if mine is step:
            continue  # a step both engines share (an ORM read), given by the store as it is
        assert inspect.signature(step) == inspect.signature(mine), name
        # The PostgreSQL store hands its ORM path to the function of the same name.
        assert f"store_orm.{name}(" in inspect.getsource(mine), name
        handed_over += 1
    assert handed_over, f"{sql.__name__} hands no step to {orm.__name__}"
    # Nothing but the stores picks a path: a step called on the ORM store directly would
    # skip PostgreSQL's statement.
    callers = [
        path
        for path in PACKAGE.rglob("*.py")
        if path.name not in {"store.py", "store_orm.py"}
        and f"{room} import store_orm" in path.read_text()
    ]
    assert not callers, callers


MAX_MODULE_LINES = 600
"""No module of the package is longer than this (migrations aside)."""

MAX_FUNCTION_LINES = 60
"""No function is longer than this, its docstring and SQL strings not counted."""

_SQL = re.compile(r"^\s*(SELECT|WITH|UPDATE|INSERT|DELETE)\b", re.IGNORECASE)


def function_lengths(source: str) -> dict[str, int]:
    """Each function's length in lines (``name:line`` -> lines), its docstring and the SQL
    string constants in it not counted."""
    lengths: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        assert node.end_lineno is not None
        uncounted = 0
        docstring = ast.get_docstring(node, clean=False)
        first = node.body[0]
        if docstring is not None and isinstance(first, ast.Expr):
            assert first.end_lineno is not None
            uncounted += first.end_lineno - first.lineno + 1
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Constant)
                and isinstance(sub.value, str)
                and _SQL.match(sub.value)
                and sub.end_lineno is not None
            ):
                uncounted += sub.end_lineno - sub.lineno + 1
        lengths[f"{node.name}:{node.lineno}"] = node.end_lineno - node.lineno + 1 - uncounted
    return lengths


def _package_sources() -> Iterable[tuple[str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" not in path.parts:
            yield str(path.relative_to(PACKAGE)), path.read_text()


def test_no_module_over_600_lines() -> None:
    long = {name: n for name, source in _package_sources()
            if (n := len(source.splitlines())) > MAX_MODULE_LINES}  # fmt: skip
    assert not long, f"split these modules (at most {MAX_MODULE_LINES} lines): {long}"


def test_no_function_over_60_lines__docstrings_and_sql_aside() -> None:
    long = {
        f"{name}:{function}": n
        for name, source in _package_sources()
        for function, n in function_lengths(source).items()
        if n > MAX_FUNCTION_LINES
    }
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_function_lengths__count_code__not_the_docstring_or_sql() -> None:
    body = "    x = 1\n" * 5
    source = (
        'def f():\n    """Doc.\n\n    More.\n    """\n' + body
        + 'def g():\n    q = """\n        SELECT 1\n        FROM t\n    """\n' + body
    )  # fmt: skip
    assert function_lengths(source) == {"f:1": 6, "g:11": 6}
