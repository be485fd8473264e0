"""The shipped alert rules, evaluated by Prometheus' own rule engine (``promtool test
rules``) on series shaped as the collector exports them: ``tests/alerts/alerts_test.yml``
says which tenants each alert must name, and which it must not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULE_TESTS = ROOT / "tests/alerts/alerts_test.yml"
INSTALL_HINT = (
    "promtool is not installed: tests/test_alerts.py needs it "
    "(apt-get install prometheus, or run bash scripts/test.sh, which installs it)"
)


def test_alert_rules__prometheus_evaluates_them_as_their_tests_expect() -> None:
    promtool = shutil.which("promtool")
    assert promtool, INSTALL_HINT
    result = subprocess.run(
        [promtool, "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
