"""The dashboard in a real headless browser, during a tuning run.

A real service process guarded by a token; a synthetic leader rank drives it over HTTP; Debian's
chromium, driven through its chromedriver (selenium), loads ``/`` before any sample exists. The
test types the token into the page's prompt, then watches the same page (no reload) draw the
samples as they arrive and the chosen group once tuning completes, and takes a screenshot.
Selenium rather than ``chromium --dump-dom``: a dump is one snapshot after a budget of virtual
time, while "updates as samples arrive" and the token prompt need a live page and real waits.

`make test` installs chromium and chromium-driver where it runs as root with apt-get; elsewhere
this test skips and says so.
"""

import math
import os
import shutil
import struct

import pytest
import requests
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as DriverService
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.service_process import ServiceProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TOKEN = "dashboard-test-token"
MODEL = "model0"
MAX_SAMPLES = 6
WINDOW_SECONDS = 0.5
#: Flags that keep headless chromium from reaching out or needing a GPU or a sandbox here.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1024,800",
)
#: Debian's chromium binary (its /usr/bin/chromium is a shell wrapper), else whatever is on PATH.
CHROMIUM = next(
    (
        p
        for p in ("/usr/lib/chromium/chromium", shutil.which("chromium"))
        if p and os.access(p, os.X_OK)
    ),
    None,
)
CHROMEDRIVER = shutil.which("chromedriver")


def throughput(hp):
    """Iterations per second of the synthetic job: best at bucket 2^20."""
    return 60.0 + 40.0 * math.exp(-(((hp["bucket_size_2p"] - 20) / 2.5) ** 2))


class SyntheticJob:
    """A leader rank: registers, then reports windows of whatever group the service says."""

    def __init__(self, url):
        self.url = url
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {TOKEN}"
        self.register(2**24)
        self.train_iter = 0

    def register(self, gradient_bytes):
        facts = {"world_size": 2, "nnodes": 1, "local_world_size": 2,
                 "gradient_bytes": gradient_bytes}  # fmt: skip
        self.group = self.post(f"/api/v1/models/{MODEL}/register", facts)["group"]

    def post(self, path, body):
        response = self.http.post(self.url + path, json=body, timeout=10)
        assert response.status_code in (200, 409), response.text
        return response.json()

    def status(self):
        return self.http.get(self.url + "/api/v1/status", timeout=10).json()["models"][MODEL]

    def run_until(self, done, max_windows=400):
        """Report windows until ``done(status)``; the status then."""
        for _ in range(max_windows):
            status = self.status()
            if done(status):
                return status
            iterations = round(throughput(self.group["hyperparameters"]) * WINDOW_SECONDS)
            self.train_iter += iterations
            report = {
                "group_id": self.group["id"],
                "train_iter": self.train_iter,
                "iterations": iterations,
                "seconds": WINDOW_SECONDS,
            }
            self.group = self.post(f"/api/v1/models/{MODEL}/report", report)["group"]
        raise AssertionError(f"not done after {max_windows} windows: {self.status()}")


@pytest.fixture(scope="module")
def service():
    """The service process, for the module; at the end, its diagnostics hold no token."""
    args = ["--warmup-time", "1", "--sampling-confidence-time", "1"]
    args += ["--max-samples", str(MAX_SAMPLES), "--seed", "0"]
    started = ServiceProcess(*args, token=TOKEN)
    try:
        yield started
    finally:
        code = started.stop()
    stderr = started.output[1]
    assert code == 0, stderr
    assert TOKEN not in stderr


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed: `make test` installs them "
            "when run as root with apt-get (apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    # An explicit driver path: selenium then never looks for (or downloads) one.
    driver = webdriver.Chrome(options=options, service=DriverService(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def point_titles(browser, chart):
    """Each sample point's tooltip, by sample number; read in one call, since the chart is
    drawn afresh at each poll and a point found before one is stale after it."""
    return browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll(arguments[0])].map("
        "point => [point.dataset.sample, point.querySelector('title').textContent]));",
        f"{chart} circle.sample",
    )


def png_size(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_dashboard_follows_a_tuning_run(service, browser, tmp_path):
    job = SyntheticJob(service.url)
    wait = WebDriverWait(browser, 20)
    card = f'section.model[data-model="{MODEL}"]'
    chart = f"{card} svg.chart"

    # The service needs a token: the page asks for it, and says when it is wrong.
    browser.get(service.url + "/")
    token_input = wait.until(ec.visibility_of_element_located((By.ID, "token-input")))
    token_input.send_keys("not-the-token\n")
    wait.until(ec.text_to_be_present_in_element((By.ID, "token-message"), "refused"))
    browser.find_element(By.ID, "token-input").send_keys(TOKEN + "\n")
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, card)))
    assert browser.find_element(By.CSS_SELECTOR, f"{card} .name").text == MODEL
    assert browser.find_element(By.CSS_SELECTOR, f"{card} .state").text == "warmup"
    assert browser.find_element(By.CSS_SELECTOR, chart).get_attribute("data-samples") == "0"

    # Samples arrive: the same page (no reload) draws them.
    status = job.run_until(lambda s: s["samples"] >= 2)
    wait.until(lambda _: len(browser.find_elements(By.CSS_SELECTOR, f"{chart} .sample")) >= 2)
    assert browser.find_element(By.CSS_SELECTOR, f"{card} .state").text == "sampling"
    samples = browser.find_element(By.CSS_SELECTOR, f"{card} dd.samples").text
    assert samples.endswith(f"/ {MAX_SAMPLES}") and int(samples.split()[0]) >= status["samples"]
    # The default has had one sample: a point's gain says it compares with that sample alone,
    # as the launcher's progress lines do (it said "vs default").
    titles = point_titles(browser, chart)
    assert "(the default group)" in titles["1"]
    assert " vs the default's first sample) at iteration " in titles["2"]

    # Tuning completes: one point per sample, the choice starred and named.
    status = job.run_until(lambda s: s["state"] == "completed")
    wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, f"{card} .state"), "completed"))
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f"{chart} polygon.chosen")))
    points = browser.find_elements(By.CSS_SELECTOR, f"{chart} circle.sample")
    assert len(points) == status["samples"] >= 2
    hp = status["best"]["group"]["hyperparameters"]
    best = browser.find_element(By.CSS_SELECTOR, f"{card} dd.best").text
    assert best.startswith(f"bucket 2^{hp['bucket_size_2p']} B") and "vs default" in best
    # Each point's gain divides by the level drawn, the default's score as the service judges
    # it (the log's gains each divide by the default's score when the row was logged).
    for sample, title in point_titles(browser, chart).items():
        if sample != "1":
            score = float(title.split(" -> ")[1].split(" it/s")[0])
            assert f"({score / status['default_score'] - 1:+.1%} vs " in title, title
    chart_text = browser.find_element(By.CSS_SELECTOR, chart).text
    assert "training iteration" in chart_text and "throughput (it/s)" in chart_text

    screenshot = browser.get_screenshot_as_png()
    (tmp_path / "dashboard.png").write_bytes(screenshot)
    width, height = png_size(screenshot)
    assert width >= 800 and height >= 500 and len(screenshot) > 20_000

    # Wrapped again after unfreezing (more gradient bytes): tuned afresh, and the chart shows
    # the new session's samples only, not the first one's beside them.
    job.register(2**26)
    # Until the new session's first sample, its chart waits: before, it drew the first
    # session's samples and choice under the new registration's card.
    wait.until(
        lambda _: browser.find_element(By.CSS_SELECTOR, chart).get_attribute("data-samples") == "0"
    )
    assert not browser.find_elements(By.CSS_SELECTOR, f"{chart} polygon.chosen")
    status = job.run_until(lambda s: s["samples"] >= 1)
    wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, f"{card} .state"), "sampling"))
    wait.until(
        lambda _: (
            browser.find_element(By.CSS_SELECTOR, chart).get_attribute("data-samples")
            == str(status["samples"])
        )
    )
    assert not browser.find_elements(By.CSS_SELECTOR, f"{chart} polygon.chosen")

    # ?token= works too, and leaves the address at once.
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{service.url}/?token={TOKEN}")
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f"{chart} circle.sample")))
    assert "token" not in browser.current_url
    assert browser.find_element(By.ID, "token-form").is_displayed() is False


def test_a_base64_token_pasted_into_the_address_is_taken_as_it_is(browser):
    """A query decodes "+" as a space: `?token=` with an `openssl rand -base64` token was
    refused ("The service refused this token.") though it was the right one."""
    token = "k+Wq/9z+8A=="
    started = ServiceProcess("--max-samples", "2", token=token)
    try:
        browser.get(f"{started.url}/?token={token}")
        wait = WebDriverWait(browser, 20)
        wait.until(ec.text_to_be_present_in_element((By.ID, "connection"), "updated"))
        assert browser.find_element(By.ID, "token-form").is_displayed() is False
        assert "token" not in browser.current_url
    finally:
        assert started.stop() == 0


def test_the_dashboard_files_are_served_without_the_token_and_the_data_is_not(service):
    page = requests.get(service.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    script = requests.get(service.url + "/dashboard/dashboard.js", timeout=10)
    assert script.status_code == 200 and "text/javascript" in script.headers["Content-Type"]
    assert requests.get(service.url + "/dashboard/secret.txt", timeout=10).status_code == 404
    assert (
        requests.get(service.url + "/api/v1/status?token=" + TOKEN, timeout=10).status_code == 401
    )


def test_the_dashboard_shows_level2_trials_and_the_best(service, browser, tmp_path):
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {TOKEN}"

    def post(path, body):
        response = http.post(f"{service.url}/api/v1/trials{path}", json=body, timeout=10)
        assert response.status_code == 200, response.text

    wait = WebDriverWait(browser, 20)
    browser.get(f"{service.url}/?token={TOKEN}")
    wait.until(ec.text_to_be_present_in_element((By.ID, "connection"), "updated"))
    assert browser.find_element(By.ID, "trials").is_displayed() is False  # no trial yet
    knobs = {"micro_batch": 4, "accumulation": 2, "stage": 1, "checkpointing": False}
    for trial, (outcome, rate) in enumerate((("ok", 75.25), ("oom", None), ("ok", 81.0))):
        config = {"train_micro_batch_size_per_gpu": 2 + trial, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": trial % 2}, "activation_checkpointing": False}  # fmt: skip
        spec = {"trial": trial, "nnodes": 2, "purpose": "search", "knobs": knobs,
                "master_port": 29600, "config": config}  # fmt: skip
        post("", spec)
        for node in (0, 1):
            post(f"/{trial}/nodes/{node}", {"outcome": outcome, "duration": 3.0})
        record = {"trial": trial, "purpose": "search", "config": config, "outcome": outcome,
                  "throughput": rate,
                  "predicted_memory_bytes": 3 * 2**20, "peak_memory_bytes": 2**21,
                  "error": "Traceback\nOutOfMemoryError: over the cap" if rate is None else None}  # fmt: skip
        post(f"/{trial}/record", record)
    post("/finish", {"mode": "run", "chosen": 2, "knobs": knobs})
    rows = "#trials-table tbody tr"
    wait.until(lambda _: len(browser.find_elements(By.CSS_SELECTOR, rows)) == 3)
    headline = browser.find_element(By.ID, "trials-headline").text
    assert headline == "finished on 2 nodes; 3 trials recorded; chosen: trial 2"
    # Read in one call: the page renders the table afresh at each poll, and an element found
    # before a poll is stale after it (CI once failed reading a cell between the two).
    cells, best = browser.execute_script(
        "const rows = [...document.querySelectorAll(arguments[0])];"
        "return [rows.map(row => [...row.querySelectorAll('td')].map(td => td.innerText)),"
        " rows.filter(row => row.classList.contains('best')).map(row => row.cells[0].innerText)];",
        rows,
    )
    assert cells[0][:6] == ["0", "search", "ddp", "2 x 2", "ok", "75.25 samples/s"]
    assert cells[0][7:9] == ["3.0 MiB", "2.0 MiB"]  # predicted, then measured peak
    assert cells[1][4] == "oom" and cells[1][9] == "OutOfMemoryError: over the cap"
    assert best == ["2"]
    screenshot = browser.get_screenshot_as_png()  # docs/images/dashboard_trials.png is one
    (tmp_path / "dashboard_trials.png").write_bytes(screenshot)
    assert png_size(screenshot)[0] >= 800 and len(screenshot) > 20_000
