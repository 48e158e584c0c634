"""The findings atlas (experiments/, docs/findings.md): every finding runs --tiny -- its arms on the
tiny model, a step or two each -- and writes its picture and its numbers. That they run, not their
effect: the effects are measured by python experiments/<name>.py and checked by
experiments/run_all.py."""

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                  if p.stem not in ("common", "run_all"))


def test_there_are_eight_findings_or_more():
    assert len(FINDINGS) >= 8, FINDINGS


@pytest.mark.parametrize("name", FINDINGS)
def test_a_finding_runs_tiny_and_writes_its_picture_and_numbers(name, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    finding = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--tiny", "--runs", str(tmp_path / "runs"),
                                      "--out", str(tmp_path / "findings")])
    finding.main()
    numbers = json.loads((tmp_path / "findings" / f"{name}.json").read_text())
    assert numbers["tiny"] and numbers["claim"] and numbers["paper"] and "effect" in numbers
    assert numbers["series"] and numbers["machine"]
    assert (tmp_path / "findings" / f"{name}.png").stat().st_size > 10_000
    assert not (ROOT / "docs" / "findings" / f"{name}.json").exists() or \
        json.loads((ROOT / "docs" / "findings" / f"{name}.json").read_text())["tiny"] is False


def test_run_all_holds_an_effect_to_its_sign_and_its_recorded_spread(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    import run_all
    recorded = {"effect": 0.36, "effect_spread": 0.17}
    assert run_all.verdict(recorded, {"effect": 0.36}) == "held"
    assert run_all.verdict(recorded, {"effect": 0.20}) == "held"  # 0.16 from it: within
    assert run_all.verdict(recorded, {"effect": 0.60}) == "same sign, outside the spread"
    assert run_all.verdict(recorded, {"effect": 0.65}) == "same sign, outside the spread"
    assert run_all.verdict(recorded, {"effect": -0.05}) == "sign changed"
    assert run_all.verdict(recorded, {"effect": None}) == "no effect measured"
    # one seed recorded (no spread): rounding only
    assert run_all.verdict({"effect": 0.5, "effect_spread": None}, {"effect": 0.5004}) == "held"
    assert run_all.verdict({"effect": 0.5, "effect_spread": None}, {"effect": 0.52}) != "held"
