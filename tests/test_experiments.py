"""The findings atlas (experiments/, docs/findings.md): every finding runs --tiny -- its arms on the
tiny model, a step or two each -- and writes its picture and its numbers. That they run, not their
effect: the effects are measured by python experiments/<name>.py and checked by
experiments/run_all.py."""

import importlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                  if p.stem not in ("common", "run_all"))


@pytest.fixture(scope="module")
def with_tiny_model(tmp_path_factory):
    """with_tiny_model(runs): `runs` holding the folder experiments/common.tiny_model writes
    there, where tiny_model then finds it. Written once for the file (~2 s: the default model's
    tokenizer loaded, the model built and saved) and copied for each test: the same files, its
    weights drawn with seed 0."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "experiments"))
        import common
        made = Path(common.tiny_model(tmp_path_factory.mktemp("atlas")))

    def into(runs: Path) -> Path:
        shutil.copytree(made, runs / made.name)
        return runs
    return into


def test_there_are_eleven_findings_or_more():
    assert len(FINDINGS) >= 11, FINDINGS


@pytest.mark.parametrize("name", FINDINGS)
def test_a_finding_runs_tiny_and_writes_its_picture_and_numbers(name, tmp_path, monkeypatch,
                                                                 capsys, with_tiny_model):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    finding = importlib.import_module(name)
    with_tiny_model(tmp_path / "runs")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--tiny", "--runs", str(tmp_path / "runs"),
                                      "--out", str(tmp_path / "findings")])
    finding.main()
    numbers = json.loads((tmp_path / "findings" / f"{name}.json").read_text())
    assert numbers["tiny"] and numbers["claim"] and numbers["paper"] and numbers["title"]
    assert numbers["series"] and numbers["machine"] and numbers["estimated_minutes"]
    assert numbers["terms"] and "effect" in numbers
    for t in numbers["terms"].values():
        assert t["verdict"] in ("reproduced", "contradicted", "not at this scale", "inconclusive")
        assert {"effect", "effect_by_seed", "ci95", "expect", "margin"} <= set(t)
    assert (tmp_path / "findings" / f"{name}.png").stat().st_size > 10_000
    assert not (ROOT / "docs" / "findings" / f"{name}.json").exists() or \
        json.loads((ROOT / "docs" / "findings" / f"{name}.json").read_text())["tiny"] is False


def reseeded(record: dict, label: str, by_seed: list, **claim) -> dict:
    """A copy of `record` whose term `label` was measured as `by_seed` (and claims `claim`): its
    effect, interval and verdict recomputed as a finding computes them, the headline too."""
    import common
    r = json.loads(json.dumps(record))
    t = {**r["terms"][label], **claim}
    r["terms"][label] = common.term(by_seed, t["expect"], t["effect_name"], t["margin"])
    if label == next(iter(r["terms"])):
        r.update({k: r["terms"][label][k] for k in r if k in r["terms"][label]})
    return r


def test_the_pages_table_is_the_records(monkeypatch, tmp_path):
    """docs/findings.md's table is written from docs/findings/*.json (run_all.py --table): a
    record changed, or the page edited by hand, and they differ."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import run_all
    records, reruns = run_all.recorded(), run_all.recorded(run_all.RERUNS)
    assert set(records) <= set(FINDINGS)  # (a finding not yet run has no record, no row)
    page = (ROOT / "docs" / "findings.md").read_text()
    assert run_all.page_with_table(page, records, reruns) == page, \
        "docs/findings.md's tables differ from docs/findings/*.json and docs/findings/rerun/" \
        "*.json: python experiments/run_all.py --table"
    for name, r in records.items():  # every verdict on the page is the record's
        for t in run_all.terms(r).values():
            assert f"**{t['verdict']}**" in page and run_all.interval(t) in page, (name, t)
    changed = json.loads(json.dumps(records))
    changed["one_example"] = reseeded(changed["one_example"], "as much as all",
                                      [0.01, -0.01, 0.02, 0.0])  # (now within the margin)
    assert run_all.page_with_table(page, changed, reruns) != page
    # The rerun table: a row a rerun record, its verdicts against the record's.
    again = json.loads(json.dumps(records["one_example"]))
    again.update(rerun_commit="abc1234", rerun_minutes=37)
    rows = run_all.page_with_table(page, records, {**reruns, "one_example": again})
    assert "| one_example | as much as all: " in rows and "| held | abc1234 | 37 |" in rows
    again = reseeded(again, "as much as all", [-0.3, 0.05, -0.1, 0.0])
    assert "| not held (as much as all: contradicted -> inconclusive) | abc1234 | 37 |" in \
        run_all.page_with_table(page, records, {**reruns, "one_example": again})
    with pytest.raises(SystemExit, match="reruns of findings with no record: .'nothing'."):
        run_all.page_with_table(page, records, {"nothing": again})
    # A row for each rerun record, in the findings' order.
    two = run_all.page_with_table(page, records, {**reruns, "one_example": again,
                                                  "kl_penalty": {**records["kl_penalty"],
                                                                 "rerun_commit": "abc1234",
                                                                 "rerun_minutes": 48}})
    assert two.index("| kl_penalty | beta 1 holds") < two.index("| one_example | as much as")
    assert "| held | abc1234 | 48 |" in two
    # A rerun of another claim is not compared.
    other = reseeded(again, "as much as all", again["terms"]["as much as all"]["effect_by_seed"],
                     margin=0.2)
    assert "| not comparable (as much as all: another claim) |" in run_all.page_with_table(
        page, records, {"one_example": other})
    assert "| not comparable (another claim) |" in run_all.page_with_table(
        page, records, {"one_example": {**again, "claim": "another"}})
    assert "| not comparable (other seeds) |" in run_all.page_with_table(
        page, records, {"one_example": reseeded(reseeded(
            {**again, "seeds": 5}, "as much as all", [-0.4, -0.5, -0.6, -0.4, -0.5]),
            "after saturation", [0.0, 0.1, -0.1, 0.0, 0.05])})
    # A term the record has an interval for, rerun without one (under two seeds with an
    # effect), is not judged: "inconclusive" there is a default, not a measure.
    assert "| not comparable (as much as all: no interval) |" in run_all.page_with_table(
        page, records, {"one_example": reseeded(again, "as much as all", [-0.4, None, None, None])})
    no_interval = reseeded(records["one_example"], "as much as all", [-0.4, None, None, None])
    assert "| not comparable (as much as all: no interval) |" in run_all.page_with_table(
        page, {**records, "one_example": no_interval}, {"one_example": again})
    assert "| not comparable (other steps) |" in run_all.page_with_table(
        page, records, {"one_example": {**again, "steps": 6}})
    extra = json.loads(json.dumps(again))
    extra["terms"]["new"] = extra["terms"]["as much as all"]
    assert "| not comparable (other steps; new: a term the record lacks) |" in \
        run_all.page_with_table(page, records, {"one_example": {**extra, "steps": 6}})
    # What the page cannot take, in one line naming the record.
    for made, said in (({"tiny": True}, "a run of the tiny model"),
                       ({"tiny": None}, "a run of the tiny model"),
                       ({"finding": "kl_penalty"}, "its finding is 'kl_penalty', not"),
                       ({"claim": 3}, "claim must be a text"),
                       ({"paper": None}, "paper must be a text"),
                       ({"title": ""}, "title must be a text"),
                       ({"title": 3}, "title must be a text"),
                       ({"seeds": "4"}, "seeds must be a whole number above 0"),
                       ({"seeds": True}, "seeds must be a whole number above 0"),
                       ({"steps": 0}, "steps must be a whole number above 0"),
                       ({"estimated_minutes": "lots"}, "estimated_minutes must be a whole"),
                       ({"verdict": "reproduced"}, "its headline .* differs from the first term "
                                                   "in verdict"),
                       ({"terms": {}}, "terms must be a mapping"),
                       ({"rerun_commit": "abc1234 (uncommitted)"}, "is no commit"),
                       ({"rerun_commit": None}, "is no commit"),
                       ({"rerun_commit": 1234567}, "is no commit"),
                       ({"rerun_minutes": None}, "is no count of minutes"),
                       ({"rerun_minutes": True}, "is no count of minutes"),
                       ({"rerun_minutes": -3}, "is no count of minutes"),
                       ({"rerun_minutes": 12.5}, "is no count of minutes"),
                       ({"terms": ["as much as all"]}, "terms must be a mapping"),
                       ({"terms": {"a": "reproduced"}}, "term 'a': no record of a term"),
                       ({"seeds": 5}, r"effect_by_seed must be a list of 5 numbers")):
        with pytest.raises(SystemExit, match=f"one_example.json: .*{said}"):
            run_all.page_with_table(page, records, {"one_example": {**again, **made}})
    with pytest.raises(SystemExit, match="one_example.json: not a finding's record"):
        run_all.page_with_table(page, records, {"one_example": [again]})
    for key, value, said in (("verdict", None, "its verdict None is none of"),
                             ("verdict", "Reproduced", "its verdict 'Reproduced' is none of"),
                             ("verdict", "reproduced", "its verdict 'reproduced' is not what"),
                             ("effect", "0.3", "its effect '0.3' is not what"),
                             ("effect", float("nan"), "its effect nan is not what"),
                             ("effect", 10 ** 400, "its effect 1000.* is not what"),
                             ("effect", -100.0, "its effect -100.0 is not what"),
                             ("ci95", [0.1], r"its ci95 \[0.1\] is not what"),
                             ("ci95", [round(x, 6) for x in  # (a copy rounded is no record)
                                       again["terms"]["after saturation"]["ci95"]],
                              "its ci95 .* is not what"),
                             ("effect_spread", "banana", "its effect_spread 'banana' is not"),
                             ("seeds_with_effect", 99, "its seeds_with_effect 99 is not what"),
                             ("effect_by_seed", 3, "effect_by_seed must be a list of 4 numbers"),
                             ("effect_by_seed", [0.1, "x", 0.2, 0.3], "must be a list of 4"),
                             ("effect_by_seed", [1e300, -1e300, 0, 0], "too large to compute"),
                             ("effect_name", None, "effect_name must be a text"),
                             ("margin", float("nan"), "margin must be a number of at least 0"),
                             ("margin", -1, "margin must be a number of at least 0"),
                             ("expect", "bigger", "expect must be one of"),
                             ("expect", "none", "a claim of no difference needs its margin")):
        bad = json.loads(json.dumps(again))
        bad["terms"]["after saturation"][key] = value
        if key == "expect":
            bad["terms"]["after saturation"]["margin"] = None
        with pytest.raises(SystemExit, match=f"one_example.json: term 'after saturation'.*{said}"):
            run_all.page_with_table(page, records, {"one_example": bad})
    # The findings' own records are held to the same, and a file that is no JSON named.
    wrong = json.loads(json.dumps(records))
    wrong["kl_penalty"]["terms"]["beta 1 holds"]["verdict"] = "contradicted"
    with pytest.raises(SystemExit, match=r"findings/kl_penalty.json: term 'beta 1 holds': its "
                                         r"verdict 'contradicted' is not what"):
        run_all.page_with_table(page, wrong, reruns)
    # Closer than a copy rounded: the same record, its numbers recomputed in another order.
    near = json.loads(json.dumps(records))
    near["kl_penalty"]["terms"]["beta 0.1 holds"]["ci95"][0] *= 1 + 1e-12
    run_all.page_with_table(page, near, reruns)
    for bad in ('{"finding": "cut", "terms": {', "[" * 100_000 + "]" * 100_000,
                '{"finding": "cut", "finding": "cut"}'):  # (json keeps the second, unseen)
        (tmp_path / "cut.json").write_text(bad)
        with pytest.raises(SystemExit, match=r"cut.json: not a JSON record"):
            run_all.recorded(tmp_path)
    # A field that would break a row (a line break, "\r" too, a "|", a marker) is refused, naming
    # the record it came from.
    for text in ("two\nlines", "a\rcarriage return", "a | column", run_all.RERUN_END,
                 "a lone surrogate \ud800"):
        odd = json.loads(json.dumps(again))
        odd["terms"] = {text if k == "as much as all" else k: t  # (a term's name is in its row)
                        for k, t in odd["terms"].items()}
        with pytest.raises(SystemExit, match=r"rerun/one_example.json: a field breaks"):
            run_all.page_with_table(page, records, {"one_example": odd})
        broken = json.loads(json.dumps(records))
        broken["kl_penalty"]["claim"] = text
        with pytest.raises(SystemExit, match=r"findings/kl_penalty.json: a field breaks"):
            run_all.page_with_table(page, broken, reruns)
    # The markers: once each, in order, or the page is refused.
    for broken in (page + run_all.RERUN_BEGIN + "\n" + run_all.RERUN_END + "\n",
                   page.replace(run_all.RERUN_BEGIN, "@@").replace(run_all.RERUN_END,
                                                                   run_all.RERUN_BEGIN)
                   .replace("@@", run_all.RERUN_END)):
        with pytest.raises(SystemExit, match="markers must be there once each, in this order"):
            run_all.page_with_table(broken, records, reruns)
    # ... and the two tables apart: one inside the other would be written over, the page then
    # refused by the next --table.
    table = page[page.index(run_all.BEGIN):page.index(run_all.END) + len(run_all.END)]
    nested = page.replace(table, "").replace(run_all.RERUN_END, table + "\n" + run_all.RERUN_END)
    with pytest.raises(SystemExit, match="one table's markers lie within the other's"):
        run_all.page_with_table(nested, records, reruns)
    # A record of no finding (no experiments/<name>.py: its command would not run) is refused.
    with pytest.raises(SystemExit, match=r"records of no finding .*: \['common'\]"):
        run_all.page_with_table(page, {**records, "common": {**records["kl_penalty"],
                                                            "finding": "common"}}, reruns)


def test_the_page_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch):
    """run_all.py --table writes the page beside it first: a write that fails (here: a disk that
    fills) leaves the page as it was, not truncated, and no file of its own behind."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import run_all
    page = tmp_path / "findings.md"
    page.write_text("as it was\n")
    page.chmod(0o644)
    run_all.write_whole(page, "new\n")
    assert page.read_text() == "new\n" and os.listdir(tmp_path) == ["findings.md"]
    assert page.stat().st_mode & 0o777 == 0o644  # (readable by all, as it was)

    def full(*_):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(run_all.os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        run_all.write_whole(page, "newer\n")
    assert page.read_text() == "new\n" and os.listdir(tmp_path) == ["findings.md"]


def test_run_all_holds_a_finding_to_every_verdict_it_recorded(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import run_all
    def t(verdict: str) -> dict:  # (a term: its verdict, and an interval to hold)
        return {"verdict": verdict, "ci95": [0.1, 0.2]}
    was = {"terms": {"a": t("reproduced"), "b": t("inconclusive")}}
    assert run_all.held(was, was) == "held"
    again = {"terms": {"a": t("reproduced"), "b": t("contradicted")}}
    assert run_all.held(was, again) == "not held (b: inconclusive -> contradicted)"
    assert run_all.held(was, {"terms": {"a": t("reproduced")}}) == \
        "not held (b: inconclusive -> absent)"
    # A record of one term (no `terms`): its claim is compared too.
    one = {"effect_name": "gain", "expect": "positive", "margin": None, **t("reproduced")}
    assert run_all.held(one, one) == "held"
    assert run_all.held(one, {**one, "expect": "none", "margin": 0.1}) == \
        "not comparable (effect: another claim)"
    # A term without an interval, in the record or the rerun, is inconclusive by default: not
    # compared.
    assert run_all.held(one, {**one, "ci95": None, "verdict": "inconclusive"}) == \
        "not comparable (effect: no interval)"
    assert run_all.held({**one, "ci95": None, "verdict": "inconclusive"}, one) == \
        "not comparable (effect: no interval)"


def test_a_measure_every_step_leaves_the_runs_own_steps_unchanged(tmp_path, monkeypatch,
                                                                   with_tiny_model):
    """clip_higher's probe samples the policy after every step with seeds of its own: the run's
    samples, rewards and updates are those of the same run without it."""
    common = _common(monkeypatch)
    from types import SimpleNamespace
    from data import arith_heldout
    args = SimpleNamespace(runs=tmp_path, fresh=False, tiny=True)
    model = common.tiny_model(with_tiny_model(tmp_path))
    line = lambda out: ["--data", "arith", "--steps", "2", "--seed", "0", "--out",  # noqa: E731
                        str(tmp_path / "x" / out), "--model", model,
                        *common.TINY, "--eval-every", "0"]
    probe = common.ProbeEntropy(arith_heldout(2), n=2, max_new_tokens=4)
    plain = common.run_once("plain", "grpo", line("plain"), args)
    probed = common.run_once("probed", "grpo", line("probed"), args, every_step=probe)
    assert probed != plain  # (a run without the measure is not taken for one with it)
    assert [s for s, _ in common.metric(probed, "probe_entropy")] == [1, 2]
    same = ("reward", "accuracy", "completion_len", "loss", "grad_norm", "entropy_trained")
    rows = [[{k: r[k] for k in same if k in r} for r in map(json.loads, (
        f / "metrics.jsonl").read_text().splitlines())] for f in (plain, probed)]
    assert rows[0] == rows[1]
    assert common.run_once("again", "grpo", line("again"), args, every_step=probe) == probed


def test_a_run_the_atlas_was_stopped_in_goes_on_from_its_checkpoint(tmp_path, monkeypatch,
                                                                    capsys, with_tiny_model):
    """A stopped atlas (SIGTERM: the step ends and is checkpointed) started again resumes each
    stopped run of the same config -- it refused before ("holds another run's checkpoints") --
    and the resumed run ends as it would have had it never stopped."""
    import shutil
    common = _common(monkeypatch)
    from types import SimpleNamespace
    args = SimpleNamespace(runs=tmp_path, fresh=False, tiny=True)
    line = ["--data", "arith", "--steps", "2", "--seed", "0", "--save-every", "1", "--out",
            str(tmp_path / "x" / "run"), "--model", common.tiny_model(with_tiny_model(tmp_path)),
            *common.TINY, "--eval-every", "0"]
    run = common.run_once("whole", "grpo", line, args)
    rows = lambda: [(r["step"], r["reward"], r["loss"], r["grad_norm"]) for r in  # noqa: E731
                    map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    whole = rows()
    shutil.rmtree(run / "model")  # as a run stopped after its first step leaves its folder
    shutil.rmtree(run / "checkpoints" / "step_2")
    capsys.readouterr()
    assert common.run_once("stopped", "grpo", line, args) == run
    assert "resuming the run stopped in" in capsys.readouterr().out
    assert (run / "model" / "config.json").exists() and rows() == whole and len(whole) == 2
    # Its checkpoints stay. Run again from scratch (--fresh), or a config that differs, and the
    # run would refuse a folder holding them: that folder is left as it is -- nothing moved,
    # nothing lost -- and the run goes to the next free one; a second run stopped there resumes.
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    fresh = SimpleNamespace(runs=tmp_path, fresh=True, tiny=True)
    again = common.run_once("fresh", "grpo", line, fresh)
    assert again == tmp_path / "x" / "run.2" and (again / "model" / "config.json").exists()
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before
    assert "left as it is: it goes to" in capsys.readouterr().out
    # A later plain call, or another finding sharing the arm, takes the --fresh rerun: the newest.
    assert common.run_once("after --fresh", "grpo", line, args) == again
    other = [*line, "--lr", "3e-6"]
    third = common.run_once("other config", "grpo", other, args)
    assert third == tmp_path / "x" / "run.3" and "run.3" in capsys.readouterr().out
    shutil.rmtree(third / "model")  # stopped there: the atlas started again goes on with it
    assert common.run_once("stopped again", "grpo", other, args) == third
    assert "resuming the run stopped in" in capsys.readouterr().out
    # A finished run's leftover checkpoints (it lacks a measure asked for now) are not resumed
    # into: the run is made again whole, elsewhere.
    probe = SimpleNamespace(key="probe_entropy", measure=lambda session, cfg: 0.5)
    measured = common.run_once("measured", "grpo", line, args, every_step=probe)
    assert measured == tmp_path / "x" / "run.4"
    assert [s for s, _ in common.metric(measured, "probe_entropy")] == [1, 2]


def test_a_folder_holding_any_run_is_left_as_it_is_and_the_next_free_one_is_taken(
        tmp_path, monkeypatch, capsys, with_tiny_model):
    """An atlas run keeps no checkpoints: a finished run of another config (pos_neg's arms after
    their design changed) or a --fresh rerun went into the same folder, and the run itself moved
    the finished one into superseded/, where the atlas no longer sees it and --keep-superseded
    deleted it two runs later (helper-26). Any folder holding a run is left whole; the run takes
    the next free <folder>.N, past a gap in the numbers, and a stopped run beyond the gap is
    resumed."""
    import shutil
    common = _common(monkeypatch)
    from types import SimpleNamespace
    args = SimpleNamespace(runs=tmp_path, fresh=False, tiny=True)
    line = ["--data", "arith", "--steps", "1", "--seed", "0", "--out", str(tmp_path / "x" / "run"),
            "--model", common.tiny_model(with_tiny_model(tmp_path)), *common.TINY,
            "--eval-every", "0"]
    first = common.run_once("first", "grpo", line, args)
    model = (first / "model" / "model.safetensors").read_bytes()
    before = sorted(p.relative_to(first).as_posix() for p in first.rglob("*"))
    other = common.run_once("other", "grpo", [*line, "--lr", "3e-6"], args)
    fresh = common.run_once("fresh", "grpo", line, SimpleNamespace(**{**vars(args), "fresh": True}))
    assert (other, fresh) == (tmp_path / "x" / "run.2", tmp_path / "x" / "run.3")
    assert sorted(p.relative_to(first).as_posix() for p in first.rglob("*")) == before
    assert (first / "model" / "model.safetensors").read_bytes() == model
    assert "left as it is: it goes to" in capsys.readouterr().out
    # A gap: run.2 removed by hand. A run stopped in run.3 is still found and resumed; a new
    # run goes after the last number, not into the gap.
    shutil.rmtree(other)
    stopped = [*line, "--lr", "1e-6", "--steps", "2", "--save-every", "1"]
    in_4 = common.run_once("stopped", "grpo", stopped, args)
    assert in_4 == tmp_path / "x" / "run.4"
    shutil.rmtree(in_4 / "model")
    shutil.rmtree(in_4 / "checkpoints" / "step_2")
    assert common.run_once("stopped", "grpo", stopped, args) == in_4
    assert "resuming the run stopped in" in capsys.readouterr().out


def test_where_a_run_goes_finds_a_stopped_run_anywhere_and_never_a_folder_in_use(
        tmp_path, monkeypatch):
    """helper-27: a stopped run of this config is resumed wherever it is among the folder and its
    <folder>.N (the folder itself removed; an empty .2 before it); a live run (its lock held) is
    neither resumed nor written into; a file, or a name like run.² or run.02x, is no folder of
    the run's."""
    import fcntl
    import shutil
    common = _common(monkeypatch)
    import grpo
    from cli import parse_config
    base = tmp_path / "f" / "eps-high-0.28-s1"
    cfg = parse_config(grpo.Config, ["--steps", "3", "--out", str(base)])
    saved = json.dumps(json.loads(json.dumps(__import__("dataclasses").asdict(cfg), default=str)))

    def stopped(folder):
        (folder / "checkpoints" / "step_1").mkdir(parents=True)
        (folder / "checkpoints" / "step_1" / "driver_state.pt").write_bytes(b"")
        (folder / cfg.CONFIG_FILE).write_text(saved)
    # A checkpoints/step_* that --resume auto would not take (no driver state) is no stopped run
    (base.parent / "eps-high-0.28-s1.5" / "checkpoints" / "step_x").mkdir(parents=True)
    (base.parent / "eps-high-0.28-s1.5" / cfg.CONFIG_FILE).write_text(saved)
    assert not common.stopped_run(cfg, base.parent / "eps-high-0.28-s1.5")
    shutil.rmtree(base.parent / "eps-high-0.28-s1.5")
    assert common.folders(str(base) + "/") == [base, base.parent / "eps-high-0.28-s1.2"]
    stopped(tmp_path / "f" / "eps-high-0.28-s1.2")
    assert common.where_to_run(cfg, fresh=False) == (tmp_path / "f" / "eps-high-0.28-s1.2", True)
    (tmp_path / "f" / "eps-high-0.28-s1.2").rename(tmp_path / "f" / "eps-high-0.28-s1.3")
    (tmp_path / "f" / "eps-high-0.28-s1.2").mkdir()
    assert common.where_to_run(cfg, fresh=False) == (tmp_path / "f" / "eps-high-0.28-s1.3", True)
    assert common.where_to_run(cfg, fresh=True) == (base, False)
    # The run in .3 is live (its lock held): not resumed, and no run goes into it.
    stopped(base)
    lock = open(tmp_path / "f" / "eps-high-0.28-s1.3" / ".smolrl.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        assert common.where_to_run(cfg, fresh=False) == (base, True)
        assert common.where_to_run(cfg, fresh=True) == (tmp_path / "f" / "eps-high-0.28-s1.2",
                                                        False)
        assert common.holds_a_run(tmp_path / "f" / "eps-high-0.28-s1.3")
    finally:
        lock.close()
    (tmp_path / "f" / "eps-high-0.28-s1.2").rmdir()
    (tmp_path / "f" / "eps-high-0.28-s1.2").write_text("a file")
    for odd in ("eps-high-0.28-s1.\u00b2", "eps-high-0.28-s1.02x"):
        (tmp_path / "f" / odd).mkdir()
    assert common.folders(str(base)) == [base, tmp_path / "f" / "eps-high-0.28-s1.2",
                                         tmp_path / "f" / "eps-high-0.28-s1.3",
                                         tmp_path / "f" / "eps-high-0.28-s1.4"]
    assert common.where_to_run(cfg, fresh=True) == (tmp_path / "f" / "eps-high-0.28-s1.4", False)


def test_the_newest_of_equal_finished_runs_is_the_highest_number(tmp_path, monkeypatch):
    """Of two finished runs of one config whose models bear the same time (a tree copied without
    its files' times), the later folder: run.10 after run.9, by number (helper-26)."""
    import os
    common = _common(monkeypatch)
    import grpo
    from cli import parse_config
    cfg = parse_config(grpo.Config, ["--steps", "3", "--out", str(tmp_path / "f" / "run")])
    saved = json.dumps(json.loads(json.dumps(__import__("dataclasses").asdict(cfg), default=str)))
    for name in ("run", "run.9", "run.10"):
        (tmp_path / "f" / name / "model").mkdir(parents=True)
        (tmp_path / "f" / name / cfg.CONFIG_FILE).write_text(saved)
        (tmp_path / "f" / name / "model" / "config.json").write_text("{}")
        os.utime(tmp_path / "f" / name / "model" / "config.json", (1e9, 1e9))
    assert common.finished_run(tmp_path, cfg) == tmp_path / "f" / "run.10"


def test_a_run_made_before_an_option_existed_is_the_same_run_at_that_options_default(
        monkeypatch):
    """The atlas finds a finished run by its saved config: a run made before --stop-grace existed
    (its file has no such key) is this run while --stop-grace is at its default, and not where the
    option is set to something else; options that change nothing a run computes (--out,
    --resume, --stop-grace, ...) never make it another run; every other option does."""
    common = _common(monkeypatch)
    import grpo
    from cli import parse_config
    cfg = parse_config(grpo.Config, ["--steps", "3", "--out", "/tmp/a"])
    saved = json.loads(json.dumps(__import__("dataclasses").asdict(cfg), default=str))
    assert common.same_run(saved, cfg)
    older = {k: v for k, v in saved.items() if k != "stop_grace"}
    assert common.same_run(older, cfg)
    assert not common.same_run({k: v for k, v in saved.items() if k != "lr"}, cfg)
    changed = parse_config(grpo.Config, ["--steps", "3", "--out", "/tmp/b", "--stop-grace", "5",
                                         "--resume", "auto", "--keep-last", "5"])
    assert common.same_run(saved, changed)
    assert not common.same_run(saved, parse_config(grpo.Config, ["--steps", "4"]))
    assert not common.same_run({**saved, "beta": 0.5}, cfg)


# ---------------------------------------------------------------------------------------------
# The statistics (experiments/common.py) against hand-computed values


def _common(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import common
    return common


def test_final_averages_the_last_steps_by_number_and_leaves_a_seed_without_them_missing(
        monkeypatch):
    common = _common(monkeypatch)
    # clip-higher's seed 2 of the old record: points at steps 4, 5, 12 (the steps that trained a
    # token); the last 3 *steps* of 12 are 10-12, where it has one value
    assert common.final([[(4, 0.9), (5, 0.6), (12, 0.3)]], steps=12) == [0.3]
    assert common.final([[(9, 1.0), (10, 0.2), (11, 0.4), (12, 0.6)]], 12) == \
        [pytest.approx(0.4)]
    # a seed with no value after step 8 has none: missing, not step 8's
    assert common.final([[(1, 0.5), (8, 0.25)], [(12, 0.1)]], 12) == [None, 0.1]
    assert common.by_seed([0.5, None, 0.3], [0.25, 0.1, None]) == [0.25, None, None]


def test_a_missing_value_is_never_replaced_by_another(monkeypatch):
    """one example's held-out gain needs the evaluations before training and at the last step
    (once, the last evaluation stood in for a missing step 24); the surrogates' sweep never
    chooses a rate whose run logged no accuracy (once, counted as 0), and stops if none did."""
    _common(monkeypatch)
    import one_example
    import surrogates
    assert one_example.gain([(0, 0.05), (22, 0.5), (24, 0.6)], 24) == pytest.approx(0.55)
    assert one_example.gain([(0, 0.05), (22, 0.5)], 24) is None
    assert one_example.gain([(2, 0.05), (24, 0.5)], 24) is None
    assert surrogates.best({"1e-5": None, "3e-5": 0.0}) == "3e-5"
    assert surrogates.best({"1e-5": 0.3, "3e-5": 0.3}) == "1e-5"  # (a tie: the first)
    assert surrogates.best({"1e-5": 0.2, "3e-5": 0.3}) == "3e-5"
    with pytest.raises(SystemExit, match="no sweep run logged an accuracy"):
        surrogates.best({"1e-5": None, "3e-5": None})
    # The sweep: a run that logged no accuracy is None there, not 0.
    monkeypatch.setattr(surrogates, "run_arms", lambda name, arms, args, common, seeds: {
        arm: {0: arm} for arm in arms})
    monkeypatch.setattr(surrogates, "metric", lambda run, key: [] if run == "clip lr 3e-5" else
                        [(1, 0.25), (2, 0.5)])
    swept = surrogates.sweep(None)
    assert swept["clip"] == {"1e-5": 0.375, "3e-5": None} and swept["sapo"]["3e-5"] == 0.375


def test_the_interval_is_students_t_over_the_seeds_that_have_a_value(monkeypatch):
    common = _common(monkeypatch)
    # 1, 2, 3: mean 2, sd 1, t(2) = 4.303: 2 +- 4.303 / sqrt(3) = 2 +- 2.4843
    assert common.ci95([1.0, 2.0, 3.0]) == pytest.approx([2 - 2.48434, 2 + 2.48434], abs=1e-4)
    # five seeds: t(4) = 2.776; 0, 1, 2, 3, 4: sd 1.5811, half 2.776 * 1.5811 / sqrt(5) = 1.9630
    assert common.ci95([0.0, 1.0, 2.0, 3.0, 4.0]) == pytest.approx([2 - 1.96297, 2 + 1.96297],
                                                                  abs=1e-4)
    assert common.ci95([1.0, None, 3.0]) == pytest.approx([2 - 12.706, 2 + 12.706], abs=1e-3)
    assert common.ci95([1.0]) is None and common.ci95([None, None]) is None
    assert common.mean_spread([None, 1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))


def test_the_verdict_follows_from_the_interval_the_sign_and_the_margin(monkeypatch):
    verdict = _common(monkeypatch).verdict
    assert verdict([0.1, 0.5], "positive") == "reproduced"
    assert verdict([-0.5, -0.1], "positive") == "contradicted"
    assert verdict([-0.5, -0.1], "negative") == "reproduced"
    assert verdict([-0.1, 0.5], "positive") == "inconclusive"
    assert verdict([-0.1, 0.5], "positive", margin=1.0) == "not at this scale"
    assert verdict([-0.1, 0.5], "positive", margin=0.2) == "inconclusive"
    assert verdict(None, "positive") == "inconclusive"
    # a claim of no difference: within the margin, or wholly outside it
    assert verdict([-0.05, 0.08], "none", margin=0.1) == "reproduced"
    assert verdict([-0.09, 0.11], "none", margin=0.1) == "inconclusive"
    assert verdict([0.12, 0.3], "none", margin=0.1) == "contradicted"
    # a claim of no gain: below the margin, or wholly above it
    assert verdict([-0.2, 0.04], "not positive", margin=0.05) == "reproduced"
    assert verdict([0.06, 0.2], "not positive", margin=0.05) == "contradicted"
    assert verdict([-0.1, 0.2], "not positive", margin=0.05) == "inconclusive"
    # a claim of no loss (NSR keeps pass@k): above -margin, or wholly below it
    assert verdict([-0.04, 0.2], "not negative", margin=0.05) == "reproduced"
    assert verdict([-0.2, -0.06], "not negative", margin=0.05) == "contradicted"
    assert verdict([-0.2, 0.1], "not negative", margin=0.05) == "inconclusive"
    # on the margin itself: within it reproduces, touching it from outside does not contradict
    assert verdict([-0.05, 0.2], "not negative", margin=0.05) == "reproduced"
    assert verdict([-0.3, -0.05], "not negative", margin=0.05) == "inconclusive"
    assert verdict([-0.2, 0.05], "not positive", margin=0.05) == "reproduced"
    assert verdict([0.05, 0.3], "not positive", margin=0.05) == "inconclusive"
    for expect in ("none", "not positive", "not negative"):
        with pytest.raises(ValueError, match="margin"):
            verdict([0.0, 0.1], expect)
    with pytest.raises(ValueError, match="expect"):
        verdict([0.0, 0.1], "up")


def test_the_old_records_seeds_give_the_verdicts_the_issue_computed(monkeypatch):
    term = _common(monkeypatch).term
    # lenient verifier, +0.34 +- 0.29 over 3 seeds: the interval includes 0
    lenient = term([0.23958, 0.66667, 0.11458], "positive", "share")
    assert lenient["ci95"] == pytest.approx([-0.3788, 1.0594], abs=1e-3)
    assert lenient["verdict"] == "inconclusive" and lenient["seeds_with_effect"] == 3
    # one example, -0.003 +- 0.08: an interval +-0.2 wide cannot show equivalence within 0.1
    one = term([0.09375, -0.0625, -0.0390625], "none", "gain", margin=0.1)
    assert one["ci95"][0] < -0.1 < 0.1 < one["ci95"][1] and one["verdict"] == "inconclusive"
    assert term([1.0, None], "positive", "x")["verdict"] == "inconclusive"  # one seed: no interval


def test_steps_to_a_target_and_a_correlation(monkeypatch):
    common = _common(monkeypatch)
    steps_to = common.steps_to
    series = [(1, 0.0), (2, 0.6), (3, 0.3), (4, 0.6), (5, 0.9)]
    assert steps_to(series, 0.5) == 4  # (0.6 + 0.3 + 0.6) / 3 = 0.5 at step 4
    assert steps_to(series, 0.95) is None
    assert common.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert common.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)  # cov 0.5 / (1 * 1)
    assert common.pearson([1, 2], [1, 2]) is None and common.pearson([1, 2, 3], [5, 5, 5]) is None


def test_the_length_bias_mechanism_sees_seq_mean_push_long_wrong_answers_down_less(
        tmp_path, monkeypatch, with_tiny_model):
    """length_bias.one_update_shift on one batch (the tiny model, two groups of 8, one right
    answer each, wrong ones of 2 to 48 tokens): after one update by seq-mean, a wrong answer's
    change of log-prob per token rises with its length (it is pushed down less); by seq-sum-norm
    it does not, and token-mean's changes are seq-sum-norm's scaled (both a fixed denominator)."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import torch
    import length_bias
    from common import pearson, tiny_model
    from grpo import group_advantages
    torch.manual_seed(0)
    lens = [2, 4, 8, 16, 24, 32, 40, 48] * 2
    completions = [torch.randint(100, 5000, (n,)).tolist() for n in lens]
    rewards = torch.tensor([1.0] + [0.0] * 14 + [1.0])
    advantages = group_advantages(rewards, 8)
    wrong = [i for i in range(16) if rewards[i] == 0]
    model = tiny_model(with_tiny_model(tmp_path))
    shifts = {agg: length_bias.one_update_shift(model, [[1, 2, 3, 4, 5]] * 16,
                                                completions, advantages, agg, 1.0, 48)
              for agg in ("seq-mean", "seq-sum-norm", "token-mean")}
    corr = {agg: pearson([lens[i] for i in wrong], [float(s[i]) for i in wrong])
            for agg, s in shifts.items()}
    assert corr["seq-mean"] > 0.3 > abs(corr["seq-sum-norm"])
    assert corr["token-mean"] == pytest.approx(corr["seq-sum-norm"], abs=0.01)


def test_the_random_reward_is_a_fair_draw_not_a_function_of_the_text(monkeypatch):
    """spurious_rewards' control: the same text gets 0 or 1 at random, half the time each (a
    hash of the text, as it was, gives the same text the same reward -- learnable)."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import torch
    import spurious_rewards
    torch.manual_seed(0)
    rewards = spurious_rewards.random_reward(prompts=None, completions=["The answer is 5."] * 400)
    assert set(rewards) == {0.0, 1.0} and 0.45 < sum(rewards) / 400 < 0.55
    torch.manual_seed(0)  # (the engine seeds torch's generator every step: reproducible)
    assert spurious_rewards.random_reward(prompts=None, completions=["x"] * 400) == rewards


def test_a_rerun_takes_up_earlier_runs_only_for_a_committed_tree(monkeypatch, tmp_path):
    """run_all.py reruns into a folder named by the commit, so a stopped rerun goes on where it
    stopped; with uncommitted changes (or no git) that name cannot tell the trees apart, and a
    rerun would report 'held' from runs made before the change: there every run is made anew, in
    a folder of its own -- in the commit's, a clean rerun after the edit was undone took the
    edited code's runs as its own (helper-26). Whether the tree is clean is read once."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import run_all
    said = []

    def run(line, check):
        said.append(line)
        name = Path(line[1]).stem
        out = Path(line[line.index("--out") + 1])
        record = json.loads((run_all.RECORDED / f"{name}.json").read_text())
        (out / f"{name}.json").write_text(json.dumps({**record, "tiny": "--tiny" in line}))
    monkeypatch.setattr(run_all.subprocess, "run", run)
    monkeypatch.setattr(run_all, "ROOT", tmp_path)
    monkeypatch.setattr(run_all, "commit", lambda: "abc1234")
    monkeypatch.setattr(run_all, "tree", lambda: "as it was")
    for clean in (True, False):
        monkeypatch.setattr(run_all, "committed", lambda: clean)
        monkeypatch.setattr(sys, "argv", ["run_all.py", "lenient_verifier", "sharpening", "--tiny"])
        run_all.main()
    runs = [Path(line[line.index("--runs") + 1]) for line in said]
    assert ["--fresh" in line for line in said] == [False, False, True, True]
    assert runs[0] == runs[1] == tmp_path / "out" / "experiments" / "rerun-abc1234"
    assert runs[2] == runs[3] and runs[2].name.startswith("rerun-abc1234-uncommitted-")
    # Each rerun's record is kept beside its runs, saying which commit made it.
    kept = json.loads((runs[0] / "records" / "sharpening.json").read_text())
    assert kept["rerun_commit"] == "abc1234" and kept["rerun_minutes"] == 0
    assert json.loads((runs[2] / "records" / "sharpening.json").read_text())["rerun_commit"] \
        == "abc1234 (uncommitted)"
    # Read before and after each finding: an edit or a commit while it runs stops it, in one
    # line, before a finding whose runs would come from other code is reported (helper-27) or
    # its record kept (helper-60). An already dirty tree edited again is caught too (its diff
    # changed, helper-28).
    for folder in set(runs):
        shutil.rmtree(folder / "records")
    for clean in (True, False):
        monkeypatch.setattr(run_all, "committed", lambda: clean)
        monkeypatch.setattr(run_all, "tree", lambda n=len(said): "as it was" if len(said) <= n
                            else "edited")
        monkeypatch.setattr(sys, "argv", ["run_all.py", "lenient_verifier", "sharpening", "--tiny"])
        with pytest.raises(SystemExit, match="the tree changed while run_all ran .*: "
                                             "lenient_verifier's rerun may have run the new code"):
            run_all.main()
    assert not any((folder / "records" / "lenient_verifier.json").exists() for folder in set(runs))
    # A dirty tree's runs never go where a commit's rerun looks: --runs of its own is refused.
    monkeypatch.setattr(run_all, "committed", lambda: False)
    monkeypatch.setattr(sys, "argv", ["run_all.py", "sharpening", "--runs", str(runs[0])])
    with pytest.raises(SystemExit, match="uncommitted changes .*; leave --runs out, or commit"):
        run_all.main()
    # A record that is not the finding's is refused before its runs, and a rerun that did not
    # run what was asked (the tiny model's, or not) before its record is kept.
    monkeypatch.setattr(run_all, "committed", lambda: True)
    monkeypatch.setattr(run_all, "tree", lambda: "as it was")
    monkeypatch.setattr(run_all, "RECORDED", tmp_path / "recorded")
    (tmp_path / "recorded").mkdir()
    (tmp_path / "recorded" / "sharpening.json").write_text(json.dumps({"finding": "sharpening"}))
    monkeypatch.setattr(sys, "argv", ["run_all.py", "sharpening", "--tiny"])
    with pytest.raises(SystemExit, match="recorded/sharpening.json: a run of the tiny model"):
        run_all.main()
    monkeypatch.setattr(run_all, "RECORDED", ROOT / "docs" / "findings")
    monkeypatch.setattr(run_all.subprocess, "run", lambda line, check: run(
        [x for x in line if x != "--tiny"], check))  # (a full run, where --tiny was asked)
    with pytest.raises(SystemExit, match="partial/sharpening.json: not a run of the tiny model"):
        run_all.main()
    monkeypatch.setattr(run_all.subprocess, "run", lambda line, check: run(line + ["--tiny"],
                                                                           check))
    monkeypatch.setattr(sys, "argv", ["run_all.py", "sharpening"])  # (a tiny run, where not asked)
    with pytest.raises(SystemExit, match="partial/sharpening.json: a run of the tiny model"):
        run_all.main()
    monkeypatch.setattr(sys, "argv", ["run_all.py", "rerun/sharpening"])  # (no finding's name)
    with pytest.raises(SystemExit, match="rerun/sharpening: nothing recorded"):
        run_all.main()