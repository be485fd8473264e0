"""The docs say what the code does: the SQL, the settings, the two Quick start commands; and
the documentation site builds with every warning an error."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from django_fair_jobs.conf import SETTING_NAMES

ROOT = Path(__file__).resolve().parent.parent


SQL_PAGES = ("sql.md", "sql-queues.md", "sql-dispatch.md", "sql-dispatch-functions.md")
"""The pages that print the shipped SQL, in order."""


def test_sql_pages__print_every_shipped_sql_file_in_order() -> None:
    from django_fair_jobs.sql import STATEMENT_FILES

    page = "".join((ROOT / "docs" / name).read_text() for name in SQL_PAGES)
    at = 0
    for path in (*STATEMENT_FILES, "sql/dispatch.sql"):
        block = f"`{path}`\n\n```sql\n" + (ROOT / "django_fair_jobs" / path).read_text() + "```"
        found = page.find(block, at)
        assert found >= 0, f"docs/{', '.join(SQL_PAGES)} must print {path} as shipped, in order"
        at = found + len(block)
    shipped = {
        str(p.relative_to(ROOT / "django_fair_jobs"))
        for p in (ROOT / "django_fair_jobs").rglob("*.sql")
    }
    # Every statement file is loaded and printed, then sql/dispatch.sql, the functions a
    # migration installs.
    assert shipped == {*STATEMENT_FILES, "sql/dispatch.sql"}


def test_reference__lists_every_setting() -> None:
    reference = (ROOT / "docs/reference.md").read_text()
    missing = [name for name in SETTING_NAMES if f"`FAIR_JOBS_{name}`" not in reference]
    assert not missing


def test_readme__short__a_diagram__every_link_resolves__no_figure_left_to_fill() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "```mermaid\n" in readme  # a job's path, which GitHub renders
    assert not re.findall(r"\{[A-Z_0-9]+\}", readme)
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_readme__quick_start_has_two_commands_demo_first() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "scripts/test.sh" in (ROOT / ".ci/run").read_text()


def test_docs_site__builds_with_warnings_as_errors(tmp_path: Path) -> None:
    # mkdocs.yml is strict: a broken link or anchor, or a page left out of the nav, fails.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "concepts/index.html").exists()
    # Each page has one reader and one job, and stays short enough to read.
    long = [p.name for p in (ROOT / "docs").glob("*.md") if len(p.read_text().splitlines()) > 800]
    assert not long, f"pages over 800 lines: {long}"
    # The quickstart's steps render as one numbered list: a block not indented under its
    # step would end the list, and the next steps would start again from 1.
    page = (tmp_path / "quickstart/index.html").read_text()
    section = page.split('id="add-it-to-your-project"', 1)[1].split("<h2", 1)[0]
    assert section.count("<ol>") == 1, section
    steps = section.split("<ol>", 1)[1].split("</ol>", 1)[0]
    assert steps.count("\n<li>") + steps.startswith("\n<li>") >= 5, steps


def _fair_classes(tree: ast.AST, fair: dict[str, dict[str, ast.expr]]) -> None:
    """Add to ``fair`` each class of ``tree`` that derives from one of ``fair``, with the
    options of its body over its base's."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in fair]
            if bases:
                own = {
                    t.id: stmt.value
                    for stmt in node.body
                    if isinstance(stmt, ast.Assign)
                    for t in stmt.targets
                    if isinstance(t, ast.Name)
                }
                fair[node.name] = {**fair[bases[0]], **own}


def _fair_tasks(
    tree: ast.AST, fair: dict[str, dict[str, ast.expr]]
) -> list[tuple[str, dict[str, ast.expr]]]:
    """Each task ``tree`` defines whose ``base=`` is one of the ``fair`` classes: its name,
    and its options from the decorator's keywords over its base class's body."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if not isinstance(decorator, ast.Call):
                continue
            keywords = {k.arg: k.value for k in decorator.keywords if k.arg}
            base = keywords.get("base")
            if isinstance(base, ast.Name) and base.id in fair:
                found.append((node.name, {**fair[base.id], **keywords}))
    return found


def test_docs__every_fair_task_example_is_dispatched_unless_it_says_otherwise() -> None:
    # One recommended task on every page: fair dispatch, with fair_dispatch=True written
    # out where a cap or another option is added (such an option alone turns it off), or
    # fair_dispatch=False where a recipe wants another mechanism on purpose.
    from django_fair_jobs.task import MECHANISM_OPTIONS

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong, seen = [], 0
    for page in pages:
        trees = []
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            try:
                trees.append(ast.parse(textwrap.dedent(block)))
            except SyntaxError:
                continue  # a fragment, not a program
        # A page's classes serve its later examples (a recipe defines PerMerchant once).
        fair: dict[str, dict[str, ast.expr]] = {"FairTask": {}}
        for tree in trees:
            _fair_classes(tree, fair)
        for tree in trees:
            for name, options in _fair_tasks(tree, fair):
                seen += 1
                said = options.get("fair_dispatch")
                others = [o for o in MECHANISM_OPTIONS if o in options] + (
                    ["fair_slots"] if "fair_slots" in options else []
                )
                if said is None and others:
                    wrong.append(f"{page.name}: {name} sets {', '.join(others)}")
    assert seen >= 7  # the examples the pages hold today: the parser finds them
    assert not wrong, "write fair_dispatch=True (or False on purpose): " + "; ".join(wrong)


def _pages() -> list[Path]:
    """The README and every page of the docs but the changelog (which names what was)."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                        if p.name != "changelog.md")]  # fmt: skip


def test_docs__every_setting_command_and_admin_page_named_exists() -> None:
    from django.contrib import admin
    from django.core.management import get_commands

    known_settings = {*SETTING_NAMES, "CHAOS_BROKER"}
    commands = {*get_commands(), "migrate_schemas"} | {
        p.stem for p in (ROOT / "example_project").glob("*/management/commands/*.py")
    }
    pages = {
        str(model._meta.verbose_name_plural).lower()
        for model in admin.site._registry
        if model._meta.app_label == "fair_jobs"
    } | {"dashboard"}
    wrong = []
    for page in _pages():
        text = page.read_text()
        settings = re.findall(r"FAIR_JOBS_([A-Z_]*[A-Z])\b", text)
        wrong += [f"{page.name}: FAIR_JOBS_{n}" for n in settings if n not in known_settings]
        wrong += [f"{page.name}: manage.py {c}" for c in re.findall(r"manage\.py (\w+)", text)
                  if c not in commands]  # fmt: skip
        for named in re.findall(r"Fair jobs \u203a ([A-Z][a-z]+(?: [a-z]+)*)", text):
            if not any(p.startswith(named.lower()) for p in pages):
                wrong.append(f"{page.name}: the admin page {named}")
    assert not wrong
