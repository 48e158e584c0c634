"""report.py: the run's page, built from its folder alone, looked at in a real browser (headless
Chromium, Debian's, through selenium); and curves.png's grid."""

import json
import shutil

import pytest

from conftest import run_grpo, small_run_args

EVIL = '<script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'">'


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir, tmp_path_factory):
    """Two steps of a tiny GRPO run on problems that carry markup, every sample in detail, and one
    completion (and its tokens) rewritten to carry markup too, as a model could write it."""
    out = tmp_path_factory.mktemp("report") / "run"
    data = out.parent / "evil.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{EVIL} What is {i} + 1?",
                                        "answer": str(i + 1)}) + "\n" for i in range(12)))
    args = small_run_args(tiny_model_dir, out) + ["--data", str(data), "--steps", "2",
                                                   "--eval-every", "2", "--eval-size", "3",
                                                   "--rollout-tokens", "-1"]
    run_grpo(args)
    log = out / "rollouts.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "train")
    first["completion"], first["tokens"]["pieces"][0] = EVIL, EVIL
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    from report import write_report
    write_report(out)
    return out


def test_the_page_is_self_contained_and_shows_run_text_as_text(run_folder):
    """No address outside the file, and the markup a dataset or a model wrote arrives escaped: in
    the HTML as &lt;..., in the JSON the script reads as \\u003c... -- never as a tag."""
    page = (run_folder / "report.html").read_text()
    for remote in ("http://", "https://", "src=\"//", "@import"):
        assert remote not in page
    assert "<img" not in page and page.count("<script") == 2  # the data block and the script
    assert "&lt;script&gt;document.title" in page  # (the held-out table, escaped)
    assert "\\u003cscript\\u003edocument.title" in page  # (the samples' data)
    assert (run_folder / "report.html").stat().st_size < 5e6


def test_curves_png_is_a_grid_of_the_logged_panels(run_folder):
    from PIL import Image
    width, height = Image.open(run_folder / "curves.png").size
    assert width > 1000 and height > 600  # two columns, three rows: not the single chart


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("no Chromium here (apt-get install -y chromium chromium-driver; .ci/run does)")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def test_the_page_in_a_real_browser(run_folder, browser, tmp_path):
    """No console errors; the curves drawn; a detailed sample's tokens coloured as their values
    imply (red for a positive advantage, blue for a negative one, none for zero); the step
    browser switching steps; the markup in prompts and completions shown as text, run never."""
    from selenium.webdriver.common.by import By
    browser.get((run_folder / "report.html").as_uri())
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    assert browser.title.startswith("run:") and "pwned" not in browser.title
    assert len(browser.find_elements(By.CSS_SELECTOR, "#curves .grid svg polyline")) >= 4
    assert browser.find_elements(By.CSS_SELECTOR, "#groups img, #heldout img") == []
    assert EVIL in browser.find_element(By.ID, "groups").text  # shown, as text

    def token_colours():
        return [(float(t.get_attribute("data-v")), t.value_of_css_property("background-color"))
                for t in browser.find_elements(By.CSS_SELECTOR, "#groups .tok[data-v]")]
    colours = token_colours()
    assert colours, "no coloured token on the page"
    for value, css in colours:
        r, g, b = (int(x) for x in css[css.index("(") + 1:].split(",")[:3])
        if value > 0:
            assert r == 255 and b < 255, (value, css)
        elif value < 0:
            assert b == 255 and r < 255, (value, css)
    records = [json.loads(line) for line in (run_folder / "rollouts.jsonl").read_text().splitlines()]
    step2 = next(r["completion"] for r in records if r["kind"] == "train" and r["step"] == 2
                 and r["completion"].strip())
    before = browser.find_element(By.ID, "groups").text
    browser.find_element(By.ID, "next").click()
    assert browser.find_element(By.ID, "step").get_attribute("value") == "1"
    after = browser.find_element(By.ID, "groups").text
    assert after != before and step2.strip() in after
    browser.set_window_size(390, 844)  # a phone's width: the page reflows, nothing overflows it
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= 400
    browser.save_screenshot(str(tmp_path / "phone.png"))
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
