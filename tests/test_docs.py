"""The docs say what the code does: the SQL, the settings, the two Quick start commands; and
the documentation site builds with every warning an error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from django_fair_jobs.conf import SETTING_NAMES

ROOT = Path(__file__).resolve().parent.parent


def test_how_it_works__prints_every_shipped_sql_file_in_order() -> None:
    from django_fair_jobs.sql import STATEMENT_FILES

    page = (ROOT / "docs/how-it-works.md").read_text()
    at = 0
    for path in (*STATEMENT_FILES, "sql/dispatch.sql"):
        block = f"`{path}`\n\n```sql\n" + (ROOT / "django_fair_jobs" / path).read_text() + "```"
        found = page.find(block, at)
        assert found >= 0, f"docs/how-it-works.md must print {path} as shipped, after the last"
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
