"""report.py: the run's page, built from its folder alone, looked at in a real browser (headless
Chromium, Debian's, through selenium); and charts.py: curves.png's grid, the page's SVG charts."""

import json
import re
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


# ---------------------------------------------------------------------------------------------
# Any run, any value (issue 55: 7, 8, 12, 15, 16, 18).


def _sample(step: int, index: int, group_size: int = 4, text: str = "ok", **fields) -> dict:
    """One train record of rollouts.jsonl, as rollout_log.RolloutLog.train writes it."""
    return {"v": 1, "kind": "train", "step": step, "index": index, "group": index // group_size,
            "sample": index % group_size, "kept": True,
            "row": {"problem": f"What is {index} + 1?", "answer": str(index + 1)},
            "prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "completion": text,
            "truncated": False, "policy_version": step - 1, "reward": float(index % 2),
            "rewards": {"correctness": float(index % 2)}, "correct": float(index % 2),
            "advantage": 0.5 if index % 2 else -0.5, **fields}


def _folder(path, history: list[dict], records: list[dict] = (), name: str = "run"):
    out = path / name
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    (out / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def _page_data(out) -> dict:
    """The step browser's data, as JSON.parse in the page reads it: strictly (no NaN)."""
    page = (out / "report.html").read_text()
    start = page.index('<script type="application/json" id="data">')
    data = page[page.index(">", start) + 1:page.index("</script>", start)]

    def refuse(constant):
        raise AssertionError(f"{constant} in the page's JSON: JSON.parse rejects it")
    return json.loads(data, parse_constant=refuse)


def test_a_long_run_of_many_metrics_reports_in_linear_time(tmp_path):
    """10,000 steps x 40 metrics: a few seconds (the names were gathered by scanning the whole
    history once per record and key: 26 CPU s at 1,000 steps, ~40 min at 10,000)."""
    import signal
    import time
    from report import write_report
    keys = [f"metric_{i}" for i in range(39)]
    out = _folder(tmp_path, [{"step": s, "reward": s / 1e4, **{k: s * 0.1 + i for i, k in
                                                             enumerate(keys)}}
                             for s in range(1, 10_001)])

    def too_slow(*_):
        raise TimeoutError("write_report took over 30 s on 10,000 steps x 40 metrics")
    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(30)
    try:
        t0 = time.perf_counter()
        write_report(out)
        seconds = time.perf_counter() - t0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert seconds < 10, seconds
    assert (out / "report.html").stat().st_size < 5e6


NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def test_non_finite_numbers_reach_the_page_as_json_it_can_read(tmp_path):
    """A NaN reward, an infinite advantage, a -inf log-prob: the page's data is JSON that
    JSON.parse reads (json.dumps wrote NaN, which blanked the whole step browser), and they show
    as what they are."""
    from report import write_report
    records = [_sample(1, i) for i in range(8)]
    records[0]["reward"], records[1]["advantage"] = float("nan"), float("inf")
    records[2]["rewards"]["correctness"] = float("-inf")
    records[3]["tokens"] = {"pieces": ["4", "5"], "prompt": "p", "logprob": [-float("inf"), -1.0],
                            "new_logprob": [float("nan"), -0.5], "entropy": [float("inf"), 0.1]}
    out = _folder(tmp_path, [{"step": 1, "reward": float("nan"), "loss": float("inf")}], records)
    write_report(out)
    data = _page_data(out)
    samples = [s for g in data["steps"][0]["groups"] for s in g["samples"]]
    assert len(samples) == 8
    values = json.dumps(samples)
    assert '"NaN"' in values and '"Infinity"' in values and '"-Infinity"' in values


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    """60 steps of GPU-sized batches (512 samples a step, 2,000 characters each: ~64 MB of text),
    one group a step kept token by token, and a NaN in the last step."""
    out = tmp_path_factory.mktemp("big") / "run"
    out.mkdir()
    text = ("The answer is 4, because " * 80)[:2000]
    pieces = ["tok"] * 2
    with open(out / "rollouts.jsonl", "w") as f:
        for step in range(1, 61):
            for i in range(512):
                r = _sample(step, i, group_size=16, text=text)
                if i < 16:
                    r["tokens"] = {"pieces": pieces, "prompt": "p", "logprob": [-1.0, -2.0]}
                if step == 60 and i == 0:
                    r["reward"] = float("nan")
                f.write(json.dumps(r) + "\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": s / 60}) + "\n"
                                               for s in range(1, 61)))
    from report import write_report
    write_report(out)
    return out


def test_the_page_of_a_large_run_is_bounded_and_says_what_it_keeps(big_run):
    """≤ 50 MB whatever the run's size (one string JSON.parse can take), its first and last
    steps kept whole, and the page saying, visibly, which steps it shows and where the rest is."""
    page = (big_run / "report.html").read_text()
    assert (big_run / "report.html").stat().st_size <= 50e6
    steps = [s["step"] for s in _page_data(big_run)["steps"]]
    assert steps[0] == 1 and steps[-1] == 60 and 2 < len(steps) < 60
    assert f"{len(steps)} of its 60 steps" in page and "rollouts.jsonl" in page


def test_a_step_past_its_share_is_shortened_and_says_so(tmp_path, monkeypatch):
    """A step whose texts alone pass the page's share of one step (here 50 KB of 200 KB: on
    a GPU, 512 samples of 24K tokens) shows each text cut where marked, measured as the page
    holds it -- "<" takes 6 characters there --, without token colours; steps are never
    dropped for it."""
    import report
    monkeypatch.setattr(report, "DATA_BUDGET", 200_000)
    monkeypatch.setattr(report, "STEP_BUDGET", 50_000)
    records = [_sample(s, i, text="<" * 20_000) for s in (1, 2, 3) for i in range(8)]
    records[0]["tokens"] = {"pieces": ["<", "<"], "prompt": "p", "logprob": [-1.0, -2.0]}
    out = _folder(tmp_path, [{"step": 1, "reward": 0.5}], records)
    report.write_report(out)
    steps = _page_data(out)["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for step in steps:
        assert len(report.page_json(step)) <= 50_000  # (as the page writes it: ASCII)
        for sample in (x for g in step["groups"] for x in g["samples"]):
            assert "characters left out here" in sample["text"] and "pieces" not in sample
        assert "8 texts shortened where marked" in step["note"]
    assert "texts shortened where marked" in (out / "report.html").read_text()


def test_a_cut_last_line_still_makes_the_page(tmp_path, capsys):
    """A killed write leaves a cut last line in rollouts.jsonl or metrics.jsonl: the page is
    written without it and says so (it ended in a JSONDecodeError traceback); a damaged line
    elsewhere stops report.py with one line naming the file, the line and what is wrong."""
    import report
    records = [_sample(s, i) for s in (1, 2) for i in range(4)]
    out = _folder(tmp_path, [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.7}], records)
    with open(out / "rollouts.jsonl", "a") as f:
        f.write(json.dumps(_sample(3, 0))[:50])
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')
    report.main([str(out)])
    said = capsys.readouterr().out
    assert "rollouts.jsonl, line 9: cut short" in said and "metrics.jsonl, line 3: cut short" \
        in said
    assert [s["step"] for s in _page_data(out)["steps"]] == [1, 2]
    lines = (out / "rollouts.jsonl").read_text().splitlines()
    lines[2] = '{"v": 1, "kind": "train", "step": 1, "reward'
    (out / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(out / 'rollouts.jsonl'))}, "
                                         rf"line 3: not JSON"):
        report.main([str(out)])


def test_report_py_replaces_a_link_at_report_html_and_never_writes_through_it(tmp_path):
    """`python report.py FOLDER` where report.html is a symbolic link (to a user's file): the
    page is written beside it and renamed over the link; the file it pointed to is untouched."""
    from report import write_report
    out = _folder(tmp_path, [{"step": 1, "reward": 0.5}], [_sample(1, i) for i in range(4)])
    (tmp_path / "notes.html").write_text("a user's file")
    (out / "report.html").symlink_to(tmp_path / "notes.html")
    write_report(out)
    assert (tmp_path / "notes.html").read_text() == "a user's file"
    assert not (out / "report.html").is_symlink() and _page_data(out)["steps"]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "report.html",
                                                     "rollouts.jsonl"]


def test_a_folder_or_data_name_that_is_not_utf8_makes_the_page_and_the_curves(tmp_path):
    """A name os.fsdecode gives surrogates for (a byte \\xff): the page and curves.png are
    written, the name shown with U+FFFD where its bytes are not text (it was UnicodeEncodeError
    in the page, TypeError in matplotlib's title)."""
    import os
    from charts import plot_curves
    from report import write_report
    history = [{"step": 1, "reward": 0.5, "loss": 0.1}, {"step": 2, "reward": 0.7, "loss": 0.0}]
    out = _folder(tmp_path, history, [_sample(1, i) for i in range(4)],
                  name=os.fsdecode(b"run\xff"))
    data = os.fsdecode(b"/data/pr\xffblems.jsonl")
    (out / "grpo_config.json").write_text(json.dumps({"model": "m", "data": data}))
    plot_curves(history, out / "curves.png", title=f"GRPO on {data}")
    page = write_report(out).read_text(encoding="utf-8")
    assert "run\ufffd" in page and "pr\ufffdblems.jsonl" in page
    assert (out / "curves.png").stat().st_size > 0


# Series a metric can hold: huge, constant, huge and constant, at the float limits, non-finite.
SERIES = {"huge": [0.0, 1e38] * 5, "constant": [0.25] * 10, "huge constant": [5e37] * 10,
          "float limits": [-1.7e308, 1.7e308] * 5, "non-finite": [1.0, *NON_FINITE, 2.0] * 2,
          "one point": [3.0], "none finite": list(NON_FINITE)}


@pytest.mark.parametrize("name", SERIES)
def test_svg_chart_draws_any_value_a_metric_can_hold(name):
    """Every point drawn inside the chart's frame, no NaN or inf in the SVG (it was
    ZeroDivisionError at 5e37 constant: 5e37 - 0.5 == 5e37)."""
    from charts import svg_chart
    history = [{"step": s, "reward": v} for s, v in enumerate(SERIES[name], 1)]
    svg = svg_chart(history, ("reward",), "reward")
    assert "nan" not in svg.lower() and "inf" not in svg.lower()
    for line in re.findall(r'points="([^"]*)"', svg):
        for point in line.split():
            x, y = map(float, point.split(","))
            assert 42 <= x <= 322 and 22 <= y <= 150, (name, point)



@pytest.mark.parametrize("steps", [[-1.7e308, 0.0, 1.7e308], [0.0, 5e-324], [1e308, 1.7e308],
                                   [1e17], [1.7976931348623157e308]])
def test_svg_chart_draws_any_step_a_metric_can_hold(steps):
    """Steps a crafted metrics.jsonl holds -- any finite number -- drawn inside the frame too (the
    last step less the first overflowed to inf: every point NaN, an SVG error in the browser; one
    step past 2**53, where step + 1 == step, was ZeroDivisionError)."""
    from charts import svg_chart
    svg = svg_chart([{"step": s, "reward": i} for i, s in enumerate(steps)], ("reward",), "r")
    assert "nan" not in svg.lower()
    for point in re.search(r'points="([^"]*)"', svg)[1].split():
        x, y = map(float, point.split(","))
        assert 42 <= x <= 322 and 22 <= y <= 150, (steps, point)

def _figure_of(plot, monkeypatch):
    """The matplotlib figure plot() saves."""
    from matplotlib.figure import Figure
    saved, real = [], Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return real(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    plot()
    return saved[0]


def _shows_its_data(fig):
    """Every finite point of every line inside its axes' y limits; the limits finite."""
    import numpy as np
    for ax in fig.axes:
        low, high = ax.get_ylim()
        assert np.isfinite([low, high]).all(), (ax.get_title(), low, high)
        for line in ax.get_lines():
            y = np.asarray(line.get_ydata(), dtype=float)
            y = y[np.isfinite(y)]
            if len(y):
                assert low <= y.min() and y.max() <= high, (ax.get_title(), line.get_label(),
                                                            (low, high), (y.min(), y.max()))


def test_every_curves_panel_shows_what_it_plots(tmp_path, monkeypatch):
    """A learned reward rising 3.2 -> 5.4 beside a held-out accuracy in [0, 1], a loss below 0 on
    the right axis: each on the chart (the first panel was fixed at 0-1, the loss axis at 0 up);
    a run whose figures are all fractions keeps the first panel's 0-1."""
    from charts import plot_curves
    history = [{"step": s, "reward": 3.2 + 0.22 * s, "eval_accuracy": 0.4 - 0.02 * s,
                "loss": -0.5 + 0.1 * s, "kl": 0.01 * s, "completion_len": 20.0 + s}
               for s in range(11)]
    fig = _figure_of(lambda: plot_curves(history, tmp_path / "a.png", loss_keys=("loss",)),
                     monkeypatch)
    _shows_its_data(fig)
    fractions = [{"step": s, "reward": s / 10, "accuracy": s / 20} for s in range(11)]
    fig = _figure_of(lambda: plot_curves(fractions, tmp_path / "b.png"), monkeypatch)
    assert fig.axes[0].get_ylim() == pytest.approx((-0.02, 1.02))


@pytest.mark.parametrize("name", SERIES)
def test_curves_png_draws_any_value_a_metric_can_hold(name, tmp_path, monkeypatch):
    from charts import plot_curves
    history = [{"step": s, "reward": v, "loss": v, "entropy_trained": v}
               for s, v in enumerate(SERIES[name], 1)]
    fig = _figure_of(lambda: plot_curves(history, tmp_path / "c.png", loss_keys=("loss",)),
                     monkeypatch)
    _shows_its_data(fig)
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_run_whose_picture_cannot_be_drawn_still_ends_well(tiny_model_dir, tmp_path,
                                                              monkeypatch):
    """`python grpo.py` with a reward of 1e38 for every other completion (a user's function):
    it trains, saves its model, writes its page and exits 0 (it ended in ZeroDivisionError, exit
    code 1, no report.html); and a report that fails whatever the reason is one warning line,
    never the run's exit."""
    import session
    from conftest import run_script
    (tmp_path / "huge_rewards.py").write_text(
        "def huge(prompts, completions, **_):\n"
        "    return [1e38 * (i % 2) for i in range(len(completions))]\n")
    args = small_run_args(tiny_model_dir, tmp_path / "a") + ["--steps", "2"]
    args[args.index("--reward") + 1] = "huge_rewards:huge"
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_script("grpo.py", args)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (tmp_path / "a/report.html").exists() and (tmp_path / "a/model/config.json").exists()

    def broken(*_, **__):
        raise ValueError("cannot draw this")
    monkeypatch.setattr(session, "write_report", broken)
    result = run_grpo(small_run_args(tiny_model_dir, tmp_path / "b") + ["--steps", "1"])
    warnings = [line for line in result.stdout.splitlines() if "warning" in line]
    assert warnings == [f"warning: {tmp_path / 'b/report.html'} could not be drawn (ValueError: "
                        f"cannot draw this); the run is saved, and `python report.py "
                        f"{tmp_path / 'b'}` tries the page again"]
    assert (tmp_path / "b/model/config.json").exists() and (tmp_path / "b/curves.png").exists()


def test_non_finite_numbers_and_a_large_run_in_a_real_browser(big_run, browser, tmp_path):
    """The steps the page keeps are all in the step browser (a large run's page showed 0 steps,
    and so did one NaN anywhere), with what it says it keeps; a NaN reward shows as NaN."""
    from selenium.webdriver.common.by import By
    from report import write_report
    records = [_sample(1, i) for i in range(4)]
    records[0]["reward"], records[1]["advantage"] = float("nan"), float("inf")
    records[2]["tokens"] = {"pieces": ["4", "5"], "prompt": "p", "logprob": [-float("inf"), -1.0],
                            "new_logprob": [float("nan"), -0.5]}
    small = _folder(tmp_path, [{"step": 1, "reward": float("nan")}], records)
    write_report(small)
    for out, steps in ((small, 1), (big_run, len(_page_data(big_run)["steps"]))):
        browser.get((out / "report.html").as_uri())
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
        options = browser.find_elements(By.CSS_SELECTOR, "#step option")
        assert len(options) == steps and browser.find_elements(By.CSS_SELECTOR, "#groups .sample")
    assert f"{steps} of its 60 steps" in browser.find_element(By.ID, "samples").text
    browser.get((small / "report.html").as_uri())
    heads = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#groups .sample .head")]
    assert any("reward NaN" in h for h in heads) and any("advantage Infinity" in h for h in heads)


# ---------------------------------------------------------------------------------------------
# Every field within the page's budget, whatever a log holds (issue 67: 7, 12).


def _eval(step: int, i: int, **fields) -> dict:
    """One held-out record of rollouts.jsonl, as rollout_log.RolloutLog.eval writes it."""
    return {"v": 1, "kind": "eval", "step": step, "id": str(i), "sample": 0,
            "problem": f"What is {i} + 1?", "answer": str(i + 1), "completion": "ok",
            "extracted": None, "correct": bool((i + step) % 2), "length": 2, "truncated": False,
            **fields}


def _section(page: str, name: str) -> str:
    start = page.index(f'<section id="{name}">')
    return page[start:page.index("</section>", start)]


def _budgets(monkeypatch, samples=400_000, heldout=60_000, curves=30_000, table=5_000):
    import report
    for name, value in (("DATA_BUDGET", samples), ("STEP_BUDGET", samples // 4),
                        ("HELDOUT_BUDGET", heldout), ("CURVES_BUDGET", curves),
                        ("TABLE_BUDGET", table)):
        monkeypatch.setattr(report, name, value)
    return report


def _oversized_run(tmp_path, answer: str, completion: str, problem: str, steps=3, groups=16,
                   problems=50) -> "Path":
    """A run whose every text is past a small page's budget: 16 groups a step with answers of
    `answer` (a code dataset's tests), one of them token by token with a template that is an
    object, held-out problems of `problem` and completions of `completion`, two hundred metrics
    with long names, and a config with long values."""
    records = []
    for s in range(1, steps + 1):
        for i in range(groups * 2):
            r = _sample(s, i, group_size=2, text=completion)
            r["row"] = {"prompt": [{"role": "user", "content": problem}], "answer": answer}
            if i < 2:
                r["tokens"] = {"pieces": ["<", completion], "prompt": {"chat": [problem]},
                               "logprob": [-1.0, None], "new_logprob": [None, -0.5]}
            records.append(r)
    records += [_eval(s, i, problem=problem, answer={"tests": [answer]}, completion=completion)
                for s in (0, steps) for i in range(problems)]
    history = [{"step": s, "reward": 0.5, **{f"{'<' * 300}{k}": s * k for k in range(200)}}
               for s in range(1, steps + 1)]
    out = _folder(tmp_path, history, records)
    (out / "grpo_config.json").write_text(json.dumps({"model": "m", "data": problem,
                                                      **{f"k{i}": answer for i in range(50)}}))
    return out


def test_every_field_of_a_page_stays_within_its_budget(tmp_path, monkeypatch):
    """Answers of 30,000 "<" (each written \\u003c: six bytes), prompts of non-BMP characters
    (twelve), completions past a step's share, a held-out table and metrics past theirs: the
    samples hold at most DATA_BUDGET bytes as written into the page, a step STEP_BUDGET, the
    held-out table HELDOUT_BUDGET, the charts and tables theirs; every text cut says so where it
    is cut, and the page says what it left out (the answers were never cut: 103 MB and 604 MB
    pages that Chromium would not open)."""
    report = _budgets(monkeypatch)
    out = _oversized_run(tmp_path, answer="<" * 30_000, completion="<&>" * 3_000,
                         problem="\U0001f600é" * 4_000)
    report.write_report(out)
    page = (out / "report.html").read_text()
    start = page.index('<script type="application/json" id="data">')
    data = page[page.index(">", start) + 1:page.index("</script>", start)]
    assert len(data.encode()) <= report.DATA_BUDGET
    steps = _page_data(out)["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for step in steps:
        assert len(report.page_json(step).encode()) <= report.STEP_BUDGET
        assert "token colours" in step["note"] and "shortened where marked" in step["note"]
        for group in step["groups"]:
            assert "characters left out here" in group["answer"]
    heldout = _section(page, "heldout")
    assert len(heldout.encode()) <= report.HELDOUT_BUDGET + 1_000  # (+ its heading)
    assert "characters left out here" in heldout and "problems left out" in heldout
    curves = _section(page, "curves")
    assert len(curves.encode()) <= report.CURVES_BUDGET + 50_000  # (+ the grid of panels)
    assert "of the 201 metrics" in curves
    config = _section(page, "run")
    assert len(config.encode()) <= 2 * report.TABLE_BUDGET + 1_000
    assert "more entries" in config
    assert len(page.encode()) <= report.DATA_BUDGET + report.HELDOUT_BUDGET + \
        report.CURVES_BUDGET + 2 * report.TABLE_BUDGET + 100_000


def _with(record: dict, **changes) -> dict:
    """record with `changes` made, a path "a.b" for a field inside one (... removes it)."""
    record = json.loads(json.dumps(record))
    for path, value in changes.items():
        *outer, last = path.split("__")
        target = record
        for key in outer:
            target = target[key]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return record


DETAILED = _sample(1, 0, tokens={"pieces": ["4", "5"], "prompt": "p", "logprob": [-1.0, -2.0],
                                 "new_logprob": [-0.5, -1.5], "entropy": [0.1, 0.2]})
DEEP = json.loads("[" * 900 + "]" * 900)  # (as deep as json reads: a thousand stops it)
HUGE = 10 ** 400  # (past the largest float)
# A crafted log's lines, each with what the page makes of them: a page (None) or one line.
CRAFTED = {
    "null log-probs": ([_with(DETAILED, tokens__logprob=[None, -1.0],
                              tokens__new_logprob=[-0.5, None])], None),
    "null engine log-probs": ([_with(DETAILED, engine_logprobs=[None, -1.0])],
                              "field engine_logprobs: not a list of numbers"),
    "strings for log-probs": ([_with(DETAILED, tokens__entropy=["high", 1.0])],
                              "field tokens.entropy: not a list of numbers"),
    "huge numbers": ([_with(DETAILED, reward=HUGE, advantage=-HUGE, rewards={"c": HUGE},
                            tokens__logprob=[HUGE, -1.0], engine_logprobs=[-HUGE, 1e308]),
                      _eval(0, 0, correct=HUGE), _eval(2, 0, correct=-HUGE)], None),
    "NaN everywhere": ([_with(DETAILED, reward=float("nan"), tokens__logprob=[float("nan")] * 2),
                        _eval(0, 0, correct=float("nan"))], None),
    "objects for texts": ([_with(DETAILED, row={"problem": {"q": [1, {"x": None}]},
                                                "answer": {"tests": ["assert f() == 1"]}},
                                 tokens__prompt={"chat": [1, 2]}),
                           _eval(0, 0, problem=[1, "two"], answer={"a": 1}),
                           _eval(2, 0, problem=None, answer=None)], None),
    "nested 900 deep": ([_with(DETAILED, row={"problem": DEEP, "answer": DEEP},
                               tokens__prompt=DEEP, rewards={"c": 1.0})], None),
    "chat messages of anything": ([_with(DETAILED, row={"prompt": [{"role": DEEP}, 3, None,
                                                                    {"content": {"a": 1}}]})],
                                  None),
    "no pieces": ([_with(DETAILED, tokens__pieces=...)], None),
    "a reward source's name of a megabyte": ([_with(DETAILED, rewards={"<" * 10 ** 6: 1.0})],
                                             None),
    "negative step": ([_with(DETAILED, step=-3)], "field step: not a whole number"),
    "step NaN": ([_with(DETAILED, step=float("nan"))], "field step: not a whole number"),
    "missing field": ([_with(DETAILED, completion=...)], "field completion: missing"),
    "texts of wrong types": ([_with(DETAILED, completion=["a"])], "field completion: not a string"),
    "tokens not an object": ([_with(DETAILED, tokens=[1])], "field tokens: not an object"),
}
METRICS = {
    "steps and values of any type": ['{"step": NaN, "reward": 1}', '{"step": -5, "reward": 0.5}',
                                     '{"step": "2", "reward": [1], "loss": {"a": null}}',
                                     '{"step": 3, "reward": 1e999, "eval_accuracy": -1e999}',
                                     '{"reward": 0.2}', '{}', f'{{"step": 4, "reward": {HUGE}}}',
                                     '{"step": 5, "eval_accuracy": 0.5, "loss": null}'],
    "a number of 5,000 digits": ['{"step": 1, "reward": ' + "9" * 5000 + '}'],
    "nested past json's depth": ['{"step": 1, "reward": ' + "[" * 5000 + "]" * 5000 + '}'],
    "not an object": ['[1, 2]'],
}


@pytest.mark.parametrize("name", [*CRAFTED, *METRICS])
def test_a_crafted_log_makes_a_page_or_one_line(name, tmp_path, capsys):
    """Nulls in a per-token list (TypeError), numbers past the largest float (OverflowError),
    NaN, objects where texts belong, nesting 900 deep, a megabyte of name; a negative step, a
    missing field; metrics of any type, a number json cannot read (AttributeError), a nesting it
    cannot (RecursionError): `python report.py` writes a page whose data JSON.parse reads, or
    stops in one line that names the file, the line and the field -- never a traceback."""
    import report
    records, refused = CRAFTED.get(name, ([DETAILED], None))
    metrics = METRICS.get(name, ['{"step": 1, "reward": 0.5}'])
    out = _folder(tmp_path, [], [*records, _sample(1, 1)])
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in metrics))
    if name in METRICS and name != "steps and values of any type":
        refused = "metrics.jsonl, line 1: not"
    if refused:
        with pytest.raises(SystemExit) as stop:
            report.main([str(out)])
        assert str(stop.value).startswith("error: ") and refused in str(stop.value)
        assert str(stop.value).isprintable()
        return
    report.main([str(out)])
    assert "wrote" in capsys.readouterr().out
    data = _page_data(out)
    assert data["steps"] and data["steps"][0]["groups"]
    for group in data["steps"][0]["groups"]:
        for field in ("prompt", "template", "answer"):
            assert group.get(field) is None or isinstance(group[field], str), (field, group)


@pytest.fixture(scope="module")
def oversized_page(tmp_path_factory):
    """At the real budgets: a step of 16 groups whose answers are 1.5 MiB of "<" (a code
    dataset's tests; 9 MiB each as the page writes them), held-out completions of 30 MB of
    "<" in all, an answer of non-BMP characters."""
    import report
    out = tmp_path_factory.mktemp("oversized") / "run"
    out.mkdir()
    tests = "<" * (3 << 19)
    with open(out / "rollouts.jsonl", "w") as f:
        for i in range(32):
            r = _sample(1, i, group_size=2, text="The answer is <b>4</b>.")
            r["row"]["answer"] = tests if i > 1 else "\U0001f600" * (1 << 20)
            f.write(json.dumps(r) + "\n")
        for step in (0, 2):
            for i in range(20):
                f.write(json.dumps(_eval(step, i, completion="<" * 750_000)) + "\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    report.write_report(out)
    return out


def test_a_page_past_its_budget_opens_in_a_real_browser_and_says_what_it_left_out(
        oversized_page, browser, tmp_path):
    """The page stays under 50 MB (it was 604 MB: Chromium's ERR_STRING_TOO_LONG), opens with no
    error, shows its step and its held-out table, and says, visibly, what it shortened."""
    from selenium.webdriver.common.by import By
    page = oversized_page / "report.html"
    assert page.stat().st_size <= 50e6
    browser.get(page.as_uri())
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    note = browser.find_element(By.ID, "step-note")
    assert note.is_displayed() and "shortened where marked" in note.text
    groups = browser.find_elements(By.CSS_SELECTOR, "#groups .group")
    assert len(groups) == 16 and "characters left out here" in groups[-1].text
    heldout = browser.find_element(By.ID, "heldout").text
    assert "texts shortened where marked" in heldout and "20 problems" in heldout
    browser.save_screenshot(str(tmp_path / "oversized.png"))


@pytest.mark.parametrize("alphabet", ["a", "<", "<&>\"'", "\U0001f600", "é\n\t\x1b", "\ud800a",
                                      "a<\U0001f600é&"])
def test_a_text_is_cut_within_its_budget_as_the_page_writes_it(alphabet):
    """clip: whatever the characters (each "<" six bytes in the page's JSON, four in its HTML; an
    emoji twelve and four; a lone surrogate), the text as written is within the budget, keeps its
    head and its tail, and says how many characters it left out; one that fits stays whole."""
    import random
    from report import MIN_TEXT, clip, html_size, json_size
    rng = random.Random(0)
    for size in (json_size, html_size):
        for budget in (MIN_TEXT, 1_000, 12_345):
            text = "".join(rng.choice(alphabet) for _ in range(budget * 2))
            cut = clip(text, budget, size)
            assert size(cut) <= budget and size(cut) > budget * 0.9 - 12 * 2, (size, budget)
            left = len(text) - len(cut) + len(re.search(r" \[\.\.\. .*? \.\.\.\] ", cut)[0])
            assert f"[... {left:,} characters left out here" in cut
            assert text.startswith(cut[:cut.index(" [... ")])
            assert text.endswith(cut[cut.index(" ...] ") + 6:])
            whole = text[:budget // 13]
            assert clip(whole, budget, size) == whole


def test_a_picture_that_fails_on_what_a_log_holds_warns_in_one_printable_line(capsys):
    """A picture that fails on a log's text -- a metric name with an escape sequence in it (OSC
    52, a clipboard write) in the exception's message -- is one warning line, the sequence shown
    as text, never obeyed by the terminal."""
    from pathlib import Path
    import session

    def draw():
        raise ValueError("no metric \x1b]52;c;ZWNobyBwd25lZA==\x07reward")
    assert not session._drawn(Path("out/report.html"), draw)
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and said.strip().isprintable()
    assert "\\x1b]52;c;ZWNobyBwd25lZA==\\x07reward" in said


def test_the_held_out_table_counts_its_head_in_its_budget(tmp_path, monkeypatch):
    """The table's head and its summary say the first and the last step -- four times numbers of
    up to 4,300 digits (json reads that many) -- within HELDOUT_BUDGET too (they were outside
    it: 14 kB past a full table)."""
    report = _budgets(monkeypatch)
    steps = (10 ** 4000, 10 ** 4000 + 1)
    out = _folder(tmp_path, [{"step": 1, "reward": 0.5}],
                  [_eval(s, i, problem="p" * 2_000, completion="x" * 2_000)
                   for s in steps for i in range(40)])
    report.write_report(out)
    heldout = _section((out / "report.html").read_text(), "heldout")
    assert len(heldout.encode()) <= report.HELDOUT_BUDGET + 100  # (+ its heading)
    assert "problems left out" in heldout


def test_a_step_of_more_tokens_than_a_browser_draws_quickly_colours_its_first(tmp_path):
    """Past 200,000 tokens a step, the samples after them show as plain text and the step says
    so: the browser draws a span a token, each time a step or a colouring is chosen (a million
    tokens, pieces only, took 11 s to open; three million, cheapest as empty pieces and well
    within a step's 10 MB, 66 s)."""
    from report import write_report
    records = [_sample(1, i, completion_ids=[4] * 50_000,
                       tokens={"pieces": ["a"] * 50_000}) for i in range(8)]
    out = _folder(tmp_path, [{"step": 1, "reward": 0.5}], records)
    write_report(out)
    step = _page_data(out)["steps"][0]
    samples = [x for g in step["groups"] for x in g["samples"]]
    assert [len(x.get("pieces", [])) for x in samples] == [50_000] * 4 + [0] * 4
    assert all(x["text"] == "ok" for x in samples)
    assert "4 of its 8 samples shown as plain text" in step["note"]


def test_a_fifo_where_the_config_or_machine_json_lies_is_not_read(tmp_path):
    """A run folder someone shared (a tarball keeps FIFOs) with a FIFO for machine.json or
    grpo_config.json: the page is written without them (report.py waited for a writer forever)."""
    import os
    import signal
    from report import write_report
    out = _folder(tmp_path, [{"step": 1, "reward": 0.5}], [_sample(1, 0)])
    os.mkfifo(out / "machine.json")
    os.mkfifo(out / "grpo_config.json")

    class Hung(Exception):  # (no OSError: read_object takes those)
        pass

    def hung(*_):
        raise Hung("write_report waited on a FIFO")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        write_report(out)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert "Config and machine" in (out / "report.html").read_text()
