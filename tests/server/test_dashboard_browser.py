"""`/dashboard` in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`,
installed by scripts/setup.sh) driven by selenium, against the live test server while a
shared-system-prompt workload runs. The test reads the DOM: the page asks for the API key, then
shows a hit rate > 0, the shared prefix as a tree node with the expected token count, running
numbers that change, and no prompt text. It saves a screenshot in its temp dir (and, when
`RADIXLM_DASHBOARD_SCREENSHOT` names a path, there too: that is how docs/dashboard.png is made).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_dashboard import SYSTEM, shared_prefix_tokens

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--window-size=1400,1000",
]
QUESTIONS = [
    "Which pier for the island boat?",
    "Can I bring a bicycle?",
    "Is there a night ferry?",
    "Where do I buy tickets?",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip(
            f"Chromium not installed ({CHROMIUM}, {CHROMEDRIVER} missing): "
            "run scripts/setup.sh as root (apt-get install chromium chromium-driver)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="radixlm-chromium-")
    options = Options()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Workload:
    """Concurrent chats that share one system prompt, until stopped."""

    def __init__(self, server: Any, concurrency: int = 3) -> None:
        self.server = server
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = 0
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(concurrency)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.server.url, headers=self.server.headers, timeout=120) as c:
            k = 0
            while not self.stop.is_set():
                user = f"{QUESTIONS[(i + k) % len(QUESTIONS)]} (trip {i}.{k})"
                r = c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "max_tokens": 8,
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": user},
                        ],
                    },
                )
                if r.status_code != 200:
                    self.errors.append(r.text)
                self.done += 1
                k += 1

    def __enter__(self) -> Workload:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


READ_DOM = """
const q = (sel) => Array.from(document.querySelectorAll(sel));
const t = (id) => document.getElementById(id).textContent;
return {
  status: t("status"), running: t("num-running"), waiting: t("num-waiting"), hit: t("hit-rate"),
  updates: Number(document.body.dataset.updates || 0),
  authShown: !document.getElementById("auth").hidden,
  nodes: q("rect.node").map((r) => ({
    prefix: Number(r.dataset.prefixTokens), tokens: Number(r.dataset.tokens),
    hits: Number(r.dataset.hits), state: r.dataset.state})),
  rows: q("#requests tbody tr").map((tr) => tr.dataset.state),
  memoryPaths: q("#memory-chart path").length, schedPaths: q("#sched-chart path").length,
};
"""


def test_dashboard_in_headless_chromium(browser, server, http, tokenizer, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    def dom() -> dict[str, Any]:
        """One consistent read of the page (it is redrawn every second)."""
        return browser.execute_script(READ_DOM)

    server.wait_idle()
    assert http.post("/flush_cache").status_code == 200
    browser.get(f"{server.url}/dashboard")
    # The server has an API key: the page asks for it once, then streams.
    wait_for(lambda: dom()["authShown"], 10, "the key prompt")
    browser.find_element(By.ID, "api-key").send_keys(server.api_key)
    browser.find_element(By.ID, "api-key-submit").click()
    first = wait_for(
        lambda: (d := dom())["status"] == "live" and d["updates"] >= 1 and d, 15, "a payload"
    )
    assert not first["authShown"]
    assert (first["running"], first["waiting"]) == ("0", "0")

    expected = shared_prefix_tokens(tokenizer)
    running_seen = {first["running"]}
    seen: dict[str, Any] = {}
    with Workload(server) as work:

        def settled() -> bool:
            d = dom()
            running_seen.add(d["running"])
            shared = [n for n in d["nodes"] if n["prefix"] == expected]
            seen.update(d, shared=shared)
            hit = d["hit"].rstrip("%")
            return (
                hit not in ("–", "") and float(hit) > 0
                and len(shared) == 1 and shared[0]["hits"] >= 2
                and any(v not in ("0", "–") for v in running_seen)
                and bool(d["rows"])
            )  # fmt: skip

        wait_for(settled, 60, "hit rate, shared prefix node and running requests in the DOM")
        target = os.environ.get("RADIXLM_DASHBOARD_SCREENSHOT")
        if target:
            time.sleep(20)  # for the README's picture: some history in the charts
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
    assert not work.errors, work.errors[:2]
    assert work.done >= 3
    assert set(seen["rows"]) <= {"prefill", "decoding", "waiting", "retracted", "grammar"}
    assert seen["shared"][0]["tokens"] > 0 and len(seen["nodes"]) >= 3
    assert seen["memoryPaths"] >= 3 and seen["schedPaths"] >= 2
    # Nodes carry token counts and hashes, never the prompt's text (no --dashboard-show-text).
    page = browser.page_source
    assert "Quetzalcoatl" not in page and "bicycle" not in page
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    if target:
        shutil.copy(tmp_path / "dashboard.png", target)
    # After the workload the running count falls back to 0 on the page.
    server.wait_idle()
    wait_for(lambda: dom()["running"] == "0", 10, "running back to 0")
