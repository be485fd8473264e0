"""The admin in a real browser: log in, edit a tenant's limit, see it on the dashboard.

Selenium drives headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which
scripts/test.sh installs) against pytest-django's live server. A missing browser fails
the test: it is part of the suite, never skipped. Screenshots of the dashboard go to
``FAIR_JOBS_SCREENSHOT_DIR`` when set, else to the test's temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, TypeVar

import pytest
from django.contrib.auth.models import User
from pytest_django import Settings
from pytest_django.live_server_helper import LiveServer
from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from django_fair_jobs.models import LimitChange, TenantQueueSlot
from tests.conftest import Worker

pytestmark = pytest.mark.django_db(transaction=True)
T = TypeVar("T")

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = (
    "the admin's browser test needs Debian's Chromium and its driver: "
    "apt-get install chromium chromium-driver (scripts/test.sh installs them)"
)
WAIT = 20  # seconds: a generous bound, each wait returns as soon as its condition holds
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _fast_settings(settings: Settings) -> None:
    """A fast password hasher: each login hashes once in the test, once in the server."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """Headless Chromium, always quit at the end of the test."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found; {INSTALL_HINT}", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    except WebDriverException as exc:
        pytest.fail(f"Chromium did not start ({exc.msg}); {INSTALL_HINT}", pytrace=False)
    try:
        yield driver
    finally:
        driver.quit()


def until(driver: WebDriver, condition: Callable[[WebDriver], Literal[False] | T], what: str) -> T:
    """Wait for ``condition``; on timeout, fail with the page the browser is on."""
    try:
        return WebDriverWait(driver, WAIT).until(condition)
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text
        pytest.fail(f"timed out after {WAIT} s waiting for {what}; the browser is on "
                    f"{driver.current_url}:\n{body[:3000]}", pytrace=False)  # fmt: skip


def log_in(driver: WebDriver, live_server: LiveServer, username: str, password: str) -> None:
    """Log in through the admin's login form, as a person would."""
    driver.get(f"{live_server.url}/admin/login/")
    until(driver, ec.presence_of_element_located((By.NAME, "username")), "the login form")
    driver.find_element(By.NAME, "username").send_keys(username)
    driver.find_element(By.NAME, "password").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "#login-form [type=submit]").click()
    until(
        driver,
        ec.presence_of_element_located((By.ID, "user-tools")),
        f"the admin index after logging in as {username}",
    )


def screenshot_dir(tmp_path: Path) -> Path:
    configured = os.environ.get("FAIR_JOBS_SCREENSHOT_DIR")
    directory = Path(configured) if configured else tmp_path
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def screenshot(browser: WebDriver, tmp_path: Path, name: str) -> Path:
    """Save the page as ``name`` (in ``FAIR_JOBS_SCREENSHOT_DIR`` if set) and say where."""
    path = screenshot_dir(tmp_path) / name
    assert browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def dashboard_cell(browser: WebDriver, url: str, tenant: str, queue: str) -> WebElement:
    """Open the admin dashboard at ``url`` and return ``tenant``'s cell for ``queue``."""
    browser.get(f"{url}/admin/fair_jobs/dashboard/")
    row = until(
        browser,
        ec.presence_of_element_located(
            (By.CSS_SELECTOR, f'tr.fair-tenant[data-tenant="{tenant}"]')
        ),
        f"{tenant}'s row on the dashboard",
    )
    return row.find_element(By.CSS_SELECTOR, f'span.fair-slot[data-queue="{queue}"]')


def test_edit_limit_in_browser__dashboard_shows_it_and_history_records_it(
    browser: WebDriver, live_server: LiveServer, tmp_path: Path
) -> None:
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pw")
    slot = TenantQueueSlot.objects.create(tenant="acme", queue="q", max_jobs=2)
    log_in(browser, live_server, "ops", "s3cret-pw")

    browser.get(f"{live_server.url}/admin/fair_jobs/tenantqueueslot/{slot.pk}/change/")
    max_jobs = until(
        browser, ec.element_to_be_clickable((By.ID, "id_max_jobs")), "the max_jobs input"
    )
    assert max_jobs.get_attribute("value") == "2"
    max_jobs.clear()
    max_jobs.send_keys("7")
    until(
        browser,
        ec.text_to_be_present_in_element_value((By.ID, "id_max_jobs"), "7"),
        "7 typed into max_jobs",
    )
    assert max_jobs.get_attribute("value") == "7"
    browser.find_element(By.NAME, "_save").click()
    message = until(
        browser,
        ec.visibility_of_element_located((By.CSS_SELECTOR, ".messagelist .success")),
        "the changelist's success message after saving",
    )
    assert "was changed successfully" in message.text
    slot.refresh_from_db()
    assert slot.max_jobs == 7
    change = LimitChange.objects.get(tenant="acme", queue="q")
    assert (change.user, change.field, change.old_value, change.new_value, change.source) == (
        "ops", "max_jobs", "2", "7", "admin",
    )  # fmt: skip

    cell = dashboard_cell(browser, live_server.url, "acme", "q")
    assert "q: 0 / 7" in cell.text
    # The page reloads itself.
    assert browser.find_elements(By.CSS_SELECTOR, 'meta[http-equiv="refresh"]')

    path = screenshot(browser, tmp_path, "dashboard.png")
    data = path.read_bytes()
    assert len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE)


def test_dashboard__staff_without_the_apps_permissions__forbidden(
    browser: WebDriver, live_server: LiveServer
) -> None:
    User.objects.create_user("viewer", "viewer@example.com", "s3cret-pw", is_staff=True)
    TenantQueueSlot.objects.create(tenant="acme", queue="q", max_jobs=2)
    log_in(browser, live_server, "viewer", "s3cret-pw")

    browser.get(f"{live_server.url}/admin/fair_jobs/dashboard/")
    heading = until(browser, ec.presence_of_element_located((By.TAG_NAME, "h1")), "a heading")
    assert "403" in heading.text or "Forbidden" in heading.text, browser.page_source[:2000]
    assert "fair-dashboard" not in browser.page_source


@pytest.mark.workers
def test_dispatched_flood__dashboard_and_dispatch_tenants_show_the_waiting_tenant(
    browser: WebDriver,
    live_server: LiveServer,
    tmp_path: Path,
    start_worker: Callable[..., Worker],
) -> None:
    # Fair dispatch, the default mode, during a real flood on a real worker: the
    # dashboard lists the flooding tenant with its jobs in line and its cap in force, and
    # the Dispatch tenants page gives the same cap.
    from io import StringIO

    from django.core.management import call_command

    from tests.testapp import tasks

    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pw")
    call_command("fair_jobs_limit", "fair", "--tenant", "big", "--max-jobs", "1", stdout=StringIO())
    start_worker("w", pool="threads", concurrency=2)
    results = [tasks.dispatched.delay("big", 0.5) for _ in range(12)]
    log_in(browser, live_server, "ops", "s3cret-pw")

    cell = dashboard_cell(browser, live_server.url, "big", "fair")
    assert cell.get_attribute("data-limit") == "1"
    assert "in line" in cell.text and "/ 1" in cell.text
    queue = browser.find_element(By.CSS_SELECTOR, 'tr.fair-dispatch-queue[data-queue="fair"]')
    assert queue.find_elements(By.TAG_NAME, "td")[1].text.startswith("2 + ")  # 2 threads
    path = screenshot(browser, tmp_path, "dashboard-dispatch.png")
    assert path.read_bytes().startswith(PNG_SIGNATURE)

    browser.get(f"{live_server.url}/admin/fair_jobs/dispatchtenant/")
    cap = until(
        browser,
        ec.presence_of_element_located((By.CSS_SELECTOR, "td.field-cap_in_force")),
        "the cap in force column",
    )
    assert cap.text == "1"
    screenshot(browser, tmp_path, "dispatch-tenants.png")
    assert [r.get(timeout=60) for r in results] == ["big:done"] * 12
