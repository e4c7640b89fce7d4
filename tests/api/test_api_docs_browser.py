"""/docs (Swagger UI) and /redoc render with the network blocked, in a real browser: Debian's
headless Chromium driven through Debian's chromedriver (selenium; `make browser` installs both).
Every request the pages make stays on 127.0.0.1: the assets come from the installed
fastapi-offline package, not a CDN."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from api_helpers import make_settings, server_process
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # The network is blocked: no name resolves but 127.0.0.1, and everything but loopback goes
    # to a proxy on a closed port (refused).
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",
    "--window-size=1280,2000",
]

pytestmark = pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
    reason="chromium / chromium-driver missing: `make browser` installs them",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


@pytest.fixture
def url(config_file: Path, tmp_path: Path) -> Iterator[str]:
    with server_process(make_settings(tmp_path, config_file, "sqlite", None)) as (_, base):
        yield base


def requested_urls(driver: webdriver.Chrome) -> list[str]:
    """Every URL the page sent a request to since the last call (DevTools Network events),
    less those the browser blocked itself (the Content-Security-Policy): they never left it."""
    urls: dict[str, str] = {}
    blocked: set[str] = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message["params"]
        if message["method"] == "Network.requestWillBeSent":
            urls[params["requestId"]] = params["request"]["url"]
        elif message["method"] == "Network.loadingFailed" and params.get("blockedReason"):
            blocked.add(params["requestId"])
    return [url for rid, url in urls.items() if rid not in blocked]


def off_host(urls: list[str]) -> list[str]:
    """Network requests (http, https, ws, wss) to anywhere but 127.0.0.1. Chromium's own
    chrome:// pages, data: and blob: URLs never touch the network."""
    network = ("http", "https", "ws", "wss")
    return [
        u for u in urls if urlsplit(u).scheme in network and urlsplit(u).hostname != "127.0.0.1"
    ]


@pytest.mark.timeout(120)
def test_docs_and_redoc_render_offline_with_every_operation(
    url: str, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """With the network blocked, /docs lists the API's operations (Swagger UI's operation
    blocks) and /redoc its operations in the menu; no request leaves 127.0.0.1."""
    wait = WebDriverWait(browser, 30)
    browser.get(f"{url}/docs")
    blocks = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
    paths = {b.get_attribute("data-path") for b in blocks}
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/hosts"} <= paths, paths
    shot = tmp_path / "docs.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot of /docs: {shot}")
    docs_urls = requested_urls(browser)
    assert any("/static-docs/swagger-ui-bundle.js" in u for u in docs_urls), docs_urls

    browser.get(f"{url}/redoc")
    items = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "li[data-item-id*='operation']"))
    assert len(items) >= len(paths), [i.get_attribute("data-item-id") for i in items]
    assert "POST /v1/jobs" in browser.find_element(By.TAG_NAME, "body").text.replace("\n", " ")
    shot = tmp_path / "redoc.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot of /redoc: {shot}")
    redoc_urls = requested_urls(browser)
    assert off_host(docs_urls + redoc_urls) == []
