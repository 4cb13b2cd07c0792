"""The status page in a real browser (Debian's chromium, driven by Playwright) against `kvrelay cluster --workers 2`.

A request sent while the page is open appears with its decision (candidates, winner, why the others lost) and,
picked, its timeline and the lines `kvrelay explain` prints; the page shows what the router's JSON says, and the
reuse figures /cluster reports.
The screenshot goes to the test's temporary directory, or to ``$KVRELAY_DASHBOARD_SCREENSHOT`` when set (the
README's bench/results/dashboard.png was made so), so a test run never rewrites a tracked file.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.processes import CLUSTER_READY, two_worker_cluster, wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT_ENV = "KVRELAY_DASHBOARD_SCREENSHOT"
UPDATE_S = 15.0
"""How long the page may take to show what the router knows (it polls every 1.5 s)."""

pytestmark = pytest.mark.skipif(
    not CHROMIUM.is_file(),
    reason=f"Debian's chromium is not installed at {CHROMIUM}; scripts/install_chromium.sh installs it (as root, "
    "with apt-get), as make test and .ci/run do",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    home = tmp_path_factory.mktemp("dashboard")
    model = make_tiny_model("gemma3", home / "tiny-gemma3")
    process = two_worker_cluster(home, model)
    try:
        http_url = process.wait_for(CLUSTER_READY, 120).group(1)
        wait_until(lambda: httpx.get(http_url + "/health").status_code == 200 or None, 30, "a healthy router")
        yield http_url, model.name
        process.signal(signal.SIGTERM)
        assert process.process.wait(60) == 0
    finally:
        process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def test_a_request_just_sent_appears_with_its_decision_and_timeline(
    cluster: tuple[str, str], browser, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    http_url, model = cluster
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(http_url + "/dashboard")
    expect(page.locator("#live")).to_have_text(re.compile(r"^live"), timeout=UPDATE_S * 1000)
    expect(page.locator("#workers tbody tr")).to_have_count(2, timeout=UPDATE_S * 1000)
    expect(page.locator("#workers tbody tr[data-worker-id='w1']")).to_contain_text("s ago")
    expect(page.locator("#requests")).to_contain_text("No request yet")

    # Sent after the page loaded: the page shows it without a reload. The same prompt twice: the second one's
    # chunks were seen before, so the infinite-cache bound is above zero.
    client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "the dashboard shows where each request went and why " * 6
    for _ in range(2):
        client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    state = httpx.get(http_url + "/dashboard/api/state").json()
    newest = state["requests"][0]
    rid, decision = newest["request_id"], newest["decisions"][-1]
    assert newest["finish_reason"] == "length" and newest["bound_tokens"] > 0

    card = page.locator(f".request[data-request-id='{rid}']")
    expect(card).to_be_visible(timeout=UPDATE_S * 1000)
    expect(page.locator(".request")).to_have_count(2)
    winner = card.locator(".candidates li.winner")
    expect(winner).to_have_count(1)
    expect(winner).to_have_attribute("data-worker-id", decision["winner"])
    expect(winner).to_contain_text("winner")
    losers = [c for c in decision["candidates"] if not c["winner"]]
    shown = card.locator(".candidates li[data-worker-id]:not(.winner)")
    expect(shown).to_have_count(len(losers))
    for i, loser in enumerate(losers):
        expect(shown.nth(i)).to_have_attribute("data-worker-id", loser["worker_id"])
        expect(shown.nth(i)).to_contain_text("lost: " + loser["lost_because"])
    expect(card).to_contain_text("length")
    expect(page.locator("#bound-share")).not_to_have_text(re.compile(r"^(—|0\.0%)$"))
    expect(page.locator("#ttft-p50")).to_have_text(re.compile(r"^p50 \d"))
    reuse = httpx.get(http_url + "/cluster").json()["reuse"]
    assert reuse["captured_tokens"] > 0
    figures = [f"{reuse[k]:,}" for k in ("available_tokens", "captured_tokens", "delivered_tokens")]
    expect(page.locator("#reuse-figures")).to_have_text(" → ".join(figures))

    card.click()
    expect(page).to_have_url(re.compile(f"#request={rid}$"))
    expect(page.locator("#detail-id")).to_have_text(rid, timeout=UPDATE_S * 1000)
    kinds = page.locator("#timeline tbody tr")
    expect(kinds.first).to_have_attribute("data-kind", "arrived")
    expect(kinds.last).to_have_attribute("data-kind", "ended")
    for kind in ("offered", "accepted", "restore", "first_token", "deltas"):
        expect(page.locator(f"#timeline tbody tr[data-kind='{kind}']").first).to_be_visible()
    explain = page.locator("#explain")
    expect(explain).to_contain_text(f"request {rid}: 1 attempt(s)")
    expect(explain).to_contain_text(f"winner: {decision['winner']}")
    expect(explain).to_contain_text("measured outcome")

    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "dashboard.png")
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 10_000
    assert not errors, f"the page raised: {errors}"
    page.close()
