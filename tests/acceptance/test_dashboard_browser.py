"""The dashboard in real headless Chromium (Debian's chromium and chromium-driver, through
selenium), over the real HTTP API and a seeded PostgreSQL database.

Set OUTBOXER_DASHBOARD_SCREENSHOT=path to keep the screenshot (docs/img/dashboard.png is one).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outboxer
from outboxer import load_settings
from outboxer.http import HttpApi
from outboxer.stores import create_store
from tests.http_thread import serving_in_thread
from tests.services import IN_CI

INSTALLER = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "chromium"
TOKEN = "dashboard-token-0123456789"
#: A last error as a hostile broker or proxy could write it: it must show as text, never run.
HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>&amp; "quoted"'

# The first test may install Chromium (apt-get) under CI.
pytestmark = pytest.mark.timeout(900)


def chromium() -> tuple[str, str]:
    """The paths of chromium and chromedriver. Missing, they are installed under CI
    (``scripts/chromium``) and the test is skipped locally with that command."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if (browser is None or driver is None) and IN_CI:
        subprocess.run([str(INSTALLER)], check=True, timeout=900, capture_output=True)
        browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium or chromedriver is not installed: scripts/chromium installs them")
    return browser, driver


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in containers
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def seed(url: str) -> dict[str, uuid.UUID]:
    """Rows of two destinations in every state a page shows; the ids of the problem rows."""
    with psycopg.connect(url) as conn:
        default = [outboxer.enqueue(conn, "order.placed", {"n": n}).id for n in range(7)]
        partner = [
            outboxer.enqueue(conn, "invoice.paid", {"n": n}, destinations=["partner"]).id
            for n in range(3)
        ]

        def mark(ids: list[uuid.UUID], status: str, error: str | None = None) -> None:
            conn.execute(
                "UPDATE outboxer.outbox SET status = %s, last_error = %s, attempts = 3, "
                "updated_at = now(), published_at = CASE WHEN %s = 'PUBLISHED' THEN now() END "
                "WHERE id = ANY(%s)",
                (status, error, status, ids),
            )

        mark(default[:1], "ABANDONED", HOSTILE)
        mark(default[1:2], "FAILED", "ConnectionRefusedError: [Errno 111] Connect call failed")
        mark(default[2:4], "PUBLISHED")
        mark(partner[:1], "ABANDONED", "HTTP 410 Gone: the endpoint was retired")
    return {"hostile": default[0], "failed": default[1], "partner": partner[0]}


def status_of(url: str, message_id: uuid.UUID) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT status FROM outboxer.outbox WHERE id = %s", (message_id,))
        return str(row.fetchone()[0])  # type: ignore[index]


def exists(url: str, message_id: uuid.UUID) -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT 1 FROM outboxer.outbox WHERE id = %s", (message_id,))
        return row.fetchone() is not None


def publish_more(url: str, count: int) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(
            "UPDATE outboxer.outbox SET status = 'PUBLISHED', published_at = now(), "
            "updated_at = now() WHERE seq IN (SELECT seq FROM outboxer.outbox "
            "WHERE status = 'PENDING' AND destination = 'default' ORDER BY seq LIMIT %s)",
            (count,),
        )


def test_the_dashboard_shows_the_outbox_and_requeues_and_purges_with_the_token(
    pg_url: str, browser: Any, tmp_path: pathlib.Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    ids = seed(pg_url)
    settings = load_settings({"db": pg_url}, environ={})
    with serving_in_thread(
        lambda: HttpApi(
            create_store(pg_url),
            settings,
            token=TOKEN,
            status_cache_seconds=0,
            sample_seconds=0.2,
        )
    ) as server:
        time.sleep(0.5)  # a few samples of the seeded table
        publish_more(pg_url, 2)  # then a publish rate for the chart
        time.sleep(0.5)
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 20)

        def count(destination: str, status: str) -> str:
            return str(
                browser.find_element(
                    By.CSS_SELECTOR,
                    f'#counts tr[data-destination="{destination}"] td[data-status="{status}"]',
                ).text
            )

        assert [count("default", s) for s in ("PENDING", "FAILED", "ABANDONED", "PUBLISHED")] == [
            "1",
            "1",
            "1",
            "4",
        ]
        assert [count("partner", s) for s in ("PENDING", "ABANDONED")] == ["2", "1"]

        # The chart: one rate line per destination, the default's above the baseline.
        wait.until(
            lambda _: len(browser.find_elements(By.CSS_SELECTOR, "#chart polyline.rate")) == 2
        )
        line = browser.find_element(
            By.CSS_SELECTOR, '#chart polyline.rate[data-destination="default"]'
        )
        heights = [float(point.split(",")[1]) for point in line.get_attribute("points").split()]
        assert min(heights) < max(heights), "the publish of two rows shows as a rise"

        # Hostile error text shows as text and runs nothing.
        hostile_row = f'#problems tr[data-id="{ids["hostile"]}"]'
        assert browser.find_element(By.CSS_SELECTOR, f"{hostile_row} td.error").text == HOSTILE
        assert browser.find_elements(By.CSS_SELECTOR, "#problems img, #problems script") == []
        assert browser.execute_script("return window.pwned") is None

        def purge(row: str, *, confirm: bool) -> None:
            """Click the row's purge button and answer the page's confirmation."""
            browser.find_element(By.CSS_SELECTOR, f"{row} button.purge").click()
            wait.until(expected_conditions.alert_is_present())
            alert = browser.switch_to.alert
            assert "deleted for good" in alert.text
            if confirm:
                alert.accept()
            else:
                alert.dismiss()

        # Without the token the API refuses and nothing changes.
        browser.find_element(By.CSS_SELECTOR, f"{hostile_row} button.requeue").click()
        result = browser.find_element(By.ID, "requeue-result")
        wait.until(lambda _: "Authorization: Bearer" in result.text)
        assert status_of(pg_url, ids["hostile"]) == "ABANDONED"
        failed_row = f'#problems tr[data-id="{ids["failed"]}"]'
        browser.execute_script("document.getElementById('requeue-result').textContent = ''")
        purge(failed_row, confirm=True)
        wait.until(lambda _: "Authorization: Bearer" in result.text)
        assert status_of(pg_url, ids["failed"]) == "FAILED", "no token: not purged"

        # With the token typed in the page: kept in sessionStorage, sent as a Bearer header.
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        assert browser.execute_script("return sessionStorage.getItem('outboxer-token')") == TOKEN
        browser.find_element(By.CSS_SELECTOR, f"{hostile_row} button.requeue").click()
        wait.until(lambda _: result.text.startswith("requeued 1 message(s)"))
        assert status_of(pg_url, ids["hostile"]) == "PENDING"
        assert status_of(pg_url, ids["partner"]) == "ABANDONED", "one row, not a filter"
        assert TOKEN not in browser.current_url

        screenshot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(screenshot))
        assert screenshot.stat().st_size > 10_000
        kept = os.environ.get("OUTBOXER_DASHBOARD_SCREENSHOT")
        if kept:
            shutil.copyfile(screenshot, kept)

        # Purge, with the token: asked first (no is no), then one row deleted for good.
        partner_row = f'#problems tr[data-id="{ids["partner"]}"]'
        purge(partner_row, confirm=False)
        time.sleep(0.3)
        assert exists(pg_url, ids["partner"]), "the operator said no"
        purge(partner_row, confirm=True)
        wait.until(lambda _: result.text.startswith("purged 1 message(s)"))
        assert not exists(pg_url, ids["partner"])
        assert status_of(pg_url, ids["failed"]) == "FAILED", "one row, not a filter"
        status = browser.find_element(By.CSS_SELECTOR, f"{partner_row} td.status")
        assert status.text == "PURGED"
