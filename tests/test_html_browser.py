"""The static leaderboard page in a real headless browser (Debian chromium + chromedriver, selenium):
it loads from a file:// URL, every scenario's table is there, and clicking a header sorts the rows."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.report.leaderboards import write_leaderboards
from tests.assets import need
from tests.test_leaderboard import rec, write

CHROMIUM = Path("/usr/bin/chromium")
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture(autouse=True)
def _chromium():
    need(CHROMIUM.exists(), "needs Debian chromium at /usr/bin/chromium (apt-get install -y chromium chromium-driver)")


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    drv.set_page_load_timeout(120)
    yield drv
    drv.quit()


def test_page_loads_every_scenario_and_sorts_by_a_clicked_header(tmp_path, browser):
    from selenium.webdriver.common.by import By

    recs = []
    for scenario, task in (("image-cls", "image-cls/vit"), ("llm-text", "llm-text")):
        for d, st in (("fedavg", 2.0), ("flrsp", 0.1), ("dp_gaussian", 0.8), ("base", 0.0)):
            recs.append(
                rec(
                    scenario=scenario,
                    task=task,
                    defense=d,
                    strength=st,
                    utility=None
                    if d == "base"
                    else {"accuracy": {"fedavg": 0.9, "flrsp": 0.85, "dp_gaussian": 0.6}[d]},
                )
            )
    write(tmp_path / "run", recs)
    dest = tmp_path / "run" / "leaderboards"
    write_leaderboards(tmp_path / "run")

    browser.get((dest / "index.html").as_uri())

    assert "Leaderboards" in browser.title
    for scenario in ("image-cls", "llm-text"):
        table = browser.find_element(By.ID, f"lb-{scenario}")
        headers = table.find_elements(By.CSS_SELECTOR, "thead th")
        names = [h.text for h in headers]
        col = names.index("mia/global AUROC")

        def cells(table=table):
            return [r.find_elements(By.TAG_NAME, "td") for r in table.find_elements(By.CSS_SELECTOR, "tbody tr")]

        before = [c[1].text for c in cells()]
        assert before == ["base", "fedavg", "dp_gaussian", "flrsp"]
        values = {c[1].text: float(c[col].text.split()[0]) for c in cells()}

        headers[col].click()
        ascending = [c[1].text for c in cells()]
        headers[col].click()
        descending = [c[1].text for c in cells()]

        assert ascending == sorted(values, key=values.get) != before
        assert descending == ascending[::-1]
        assert headers[col].get_attribute("aria-sort") == "descending"
    images = browser.find_elements(By.CSS_SELECTOR, ".plots img")
    assert images and all(browser.execute_script("return arguments[0].naturalWidth", im) > 0 for im in images)
