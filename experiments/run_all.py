"""Rerun findings of the atlas and say whether each verdict held; write docs/findings.md's table
from the records. A benchmark, not a test: each finding takes its arms x seeds x steps of real
runs (up to an hour and a half on a 2-core CPU; each file's docstring says its cost).

    python experiments/run_all.py length_bias              # one finding
    python experiments/run_all.py                          # every finding
    python experiments/run_all.py length_bias --tiny       # the machinery, in seconds
    python experiments/run_all.py --table                  # the page's table, from the records

A rerun goes to a folder of its own (--runs, default out/experiments/rerun-<commit>), so the
recorded runs are never taken for it nor overwritten; stopped, the same command goes on where it
stopped (each finished run found again, a stopped one resumed), and another commit reruns all.
A tree with uncommitted changes makes every run anew (--fresh), into a folder of that rerun's
own (rerun-<commit>-uncommitted-<time>), where no rerun of the commit itself looks; an edit or a
commit while it runs stops it before the next finding (or the finding just rerun) is reported.
The rerun table: finding, each term's recorded effect and 95 % interval, the rerun's, and whether
the finding held -- every term's verdict (common.verdict) the same again, for the same claim --
the commit and the minutes it took (of the command that finished it: a stopped rerun's earlier
part is not counted). Each rerun's record (the finding's JSON, with `rerun_commit` and
`rerun_minutes`) is kept beside its runs, in <runs>/records/, once the tree is known unchanged;
copied to docs/findings/rerun/, it is the page's.
The page's two tables (--table) are written between their markers from the records alone -- the
findings from docs/findings/*.json, the rerun from docs/findings/rerun/*.json and the records
they rerun: tests/test_experiments.py fails when the page and the records differ.
"""

import argparse
import collections
import json
import math
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import EXPECT, VERDICTS, term

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "findings"
RERUNS = RECORDED / "rerun"
PAGE = ROOT / "docs" / "findings.md"
BEGIN = "<!-- the findings table: written by `python experiments/run_all.py --table` from " \
        "docs/findings/*.json; do not edit by hand -->"
END = "<!-- end of the findings table -->"
RERUN_BEGIN = "<!-- the rerun table: written by `python experiments/run_all.py --table` from " \
              "docs/findings/rerun/*.json; do not edit by hand -->"
RERUN_END = "<!-- end of the rerun table -->"


def partial(runs: Path) -> Path:
    """Where a finding's rerun writes its record before run_all keeps it: nothing there is taken
    for the page."""
    return runs / "records" / "partial"


def rerun(name: str, runs: Path, tiny: bool, clean: bool) -> tuple[dict, float]:
    """The finding run again into `runs`: its record (written to <runs>/records/partial/, where
    nothing is taken for the page) and its minutes. Runs finished there before are taken again (a
    stopped rerun goes on) only for a `clean` tree (committed): with uncommitted changes, or
    outside git, a folder's name cannot tell one tree from another, so every run is made anew
    (--fresh)."""
    out = partial(runs)
    out.mkdir(parents=True, exist_ok=True)
    fresh = [] if clean else ["--fresh"]
    t0 = time.time()
    subprocess.run([sys.executable, str(ROOT / "experiments" / f"{name}.py"), *fresh,
                    "--runs", str(runs), "--out", str(out)] + (["--tiny"] if tiny else []),
                   check=True)
    return json.loads((out / f"{name}.json").read_text()), (time.time() - t0) / 60


def keep(name: str, again: dict, runs: Path, made_at: str, minutes: float) -> dict:
    """The rerun's record, saying the commit its runs were made at and the minutes, kept as
    <runs>/records/<name>.json, its picture beside it (called once the tree is known unchanged)."""
    staged = partial(runs)
    again = {**again, "rerun_commit": made_at, "rerun_minutes": round(minutes)}
    (runs / "records" / f"{name}.json").write_text(json.dumps(again, indent=1) + "\n")
    if (staged / f"{name}.png").exists():
        (staged / f"{name}.png").replace(runs / "records" / f"{name}.png")
    (staged / f"{name}.json").unlink()
    return again


def git(*args: str) -> str | None:
    """What `git args` prints in this tree; None outside a git checkout, or without git."""
    try:
        said = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    except OSError:
        return None
    return said.stdout if said.returncode == 0 else None


def commit() -> str:
    """This tree's commit, short ("unknown" outside a git checkout)."""
    return (git("rev-parse", "--short", "HEAD") or "unknown").strip()


def committed() -> bool:
    """Whether this tree is a git checkout with nothing uncommitted (untracked files count)."""
    return git("status", "--porcelain") == ""


def tree() -> str:
    """What the tree holds, in one string: its commit, and any change not committed (an edit to
    an already dirty tree changes it too)."""
    return f"{commit()} {git('status', '--porcelain')} {git('diff', 'HEAD', '--binary')}"


def unchanged(start: str, what: str) -> None:
    """Stop, in one line, if the tree is no longer as run_all found it (an edit or a commit)."""
    if tree() != start:
        raise SystemExit(f"error: the tree changed while run_all ran (an edit or a commit): "
                         f"{what}; start it again")


CLAIM = ("effect_name", "expect", "margin")  # what a term claims: a rerun must claim the same
# What a finding claims and runs: a rerun of another is not compared.
DESIGN = {"claim": "another claim", "seeds": "other seeds", "steps": "other steps"}


# A record's headline: its first term's numbers and claim, at its top level too.
HEADLINE = ("effect", "effect_spread", "effect_by_seed", "effect_name", "seeds_with_effect",
            "ci95", "expect", "margin", "verdict")


def terms(record: dict) -> dict[str, dict]:
    """A record's terms (one, the headline, for a record that has no others: its claim kept, so
    that a rerun is held to it too)."""
    return record.get("terms") or {"effect": {k: record.get(k) for k in HEADLINE}}


def held(recorded: dict, again: dict) -> str:
    """"held" where every term of the record has the same verdict in the rerun, else what
    changed; "not comparable" where the rerun's claim, seeds or steps, or a term's claim, are not
    the record's, where it has a term the record lacks, or where a term has no interval in the
    record or the rerun (under two seeds with an effect: "inconclusive" by default, not by
    measure)."""
    was, now = terms(recorded), terms(again)
    why = [said for k, said in DESIGN.items() if recorded.get(k) != again.get(k)]
    why += [f"{name}: another claim" for name, t in was.items() if name in now and
            any(now[name].get(k) != t.get(k) for k in CLAIM)]
    why += [f"{name}: a term the record lacks" for name in now if name not in was]
    why += [f"{name}: no interval" for name, t in was.items() if name in now and
            not (t.get("ci95") and now[name].get("ci95"))]
    if why:
        return "not comparable (" + "; ".join(why) + ")"
    changed = [f"{name}: {t['verdict']} -> {now[name]['verdict'] if name in now else 'absent'}"
               for name, t in was.items() if name not in now or
               now[name]["verdict"] != t["verdict"]]
    return "held" if not changed else "not held (" + "; ".join(changed) + ")"


def number(x) -> str:
    return "–" if x is None else f"{x:+.3g}".replace("-", "−")


def interval(t: dict) -> str:
    """An effect, its 95 % interval and the seeds that gave it: "+0.34 [−0.38, +1.06], 3
    seeds"."""
    ci = t.get("ci95")
    seeds = t.get("seeds_with_effect", len([v for v in t.get("effect_by_seed") or []
                                            if v is not None]))
    return f"{number(t.get('effect'))} [{number(ci[0])}, {number(ci[1])}], {seeds} seeds" \
        if ci else f"{number(t.get('effect'))}, {seeds} seed{'s' * (seeds != 1)} (no interval)"


TABLE_HEAD = ["| finding | the claim | paper | command | effect [95 % interval], seeds | verdict "
              "| runs | cost |", "|---|---|---|---|---|---|---|---|"]


def finding_row(name: str, r: dict) -> str:
    """A finding's row of docs/findings.md's table: a line a term (its effect, interval and
    verdict)."""
    effects = "<br>".join(f"*{label}*: {t['effect_name']}: **{interval(t)}**"
                          for label, t in terms(r).items())
    verdicts = "<br>".join(f"*{label}*: **{t['verdict']}**" for label, t in terms(r).items())
    runs = f"{r['seeds']} seeds x {r['steps']} steps"
    cost = f"~{r['estimated_minutes']} min" if r.get("estimated_minutes") else "–"
    title = r.get("title", name)
    slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")  # (GitHub's anchor)
    return (f"| [{title}](#{slug}) | {r['claim']} | {r['paper']} | "
            f"`python experiments/{name}.py` | {effects} | {verdicts} | {runs} | {cost} |")


RERUN_HEAD = ["| finding | recorded: effect [95 % interval] | rerun | held? | commit | minutes |",
              "|---|---|---|---|---|---|"]


def rerun_row(name: str, was: dict, again: dict) -> str:
    """A finding's row of the rerun table: its terms as recorded and as rerun, whether it held."""
    return (f"| {name} | " + "<br>".join(f"{label}: {interval(t)}" for label, t in
                                         terms(was).items()) + " | " +
            "<br>".join(f"{label}: {interval(t)}" for label, t in terms(again).items()) +
            f" | {held(was, again)} | {again.get('rerun_commit', '–')} | "
            f"{again.get('rerun_minutes', '–')} |")


def finding_names() -> list[str]:
    """The findings: a file each in experiments/, but for common.py and this one."""
    return sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                  if p.stem not in ("common", "run_all"))


def recorded(folder: Path = RECORDED) -> dict[str, dict]:
    """The records in `folder`, by finding (a file that is no JSON: one line naming it)."""
    records = {}
    for p in sorted(folder.glob("*.json")):
        try:
            records[p.stem] = json.loads(p.read_text(encoding="utf-8"), object_pairs_hook=once)
        except (OSError, ValueError, RecursionError) as e:  # (a folder, bad JSON, too deep)
            raise SystemExit(f"error: {p}: not a JSON record: {type(e).__name__}: {e}")
    return records


def once(pairs: list[tuple]) -> dict:
    """A JSON object whose keys are each given once (json keeps the last of two silently: the
    one a reader of the file does not see first)."""
    twice = sorted(k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1)
    if twice:
        raise ValueError(f"a key given twice: {twice}")
    return dict(pairs)


def between(page: str, begin: str, end: str, text: str) -> str:
    """The page with `text` between its markers `begin` and `end` (each once, in that order)."""
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise SystemExit(f"error: {PAGE}: its table markers must be there once each, in this "
                         f"order: {begin} ... {end}")
    head, rest = page.split(begin, 1)
    return head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1]


def whole(x) -> bool:
    """Whether x is a JSON integer (not a bool, which Python counts as one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def a_number(x) -> bool:
    """Whether x is a number a record may hold: finite, not a bool, not a string that reads as
    one."""
    if not (whole(x) or isinstance(x, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # (an integer too large for a float)
        return False


def same(x, y) -> bool:
    """Whether a record's value x is the value y recomputed (numbers to their last bits or so)."""
    if isinstance(y, list):
        return isinstance(x, list) and len(x) == len(y) and all(map(same, x, y))
    if isinstance(y, float):
        return a_number(x) and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
    return type(x) is type(y) and x == y


# The fields of a record the page shows, what each must be, and whether a record may leave it out.
TEXT, COUNT = "a text", "a whole number above 0 (and below a million)"
FIELDS = {"claim": (TEXT, False), "paper": (TEXT, False), "title": (TEXT, True),
          "seeds": (COUNT, False), "steps": (COUNT, False), "estimated_minutes": (COUNT, True)}
KINDS = {TEXT: lambda x: isinstance(x, str) and x.strip() != "",
         COUNT: lambda x: whole(x) and 0 < x < 10 ** 6}
# What common.term computes from a term's effect_by_seed and claim: a record must hold the same.
RECOMPUTED = ("effect", "effect_spread", "ci95", "seeds_with_effect", "verdict")


def check_record(path: Path, r, name: str, tiny: bool = False) -> None:
    """Stop, in one line naming `path`, at a record the page cannot take (record_fault)."""
    why = record_fault(r, name, tiny)
    if why:
        raise SystemExit(f"error: {path}: {why}")


def record_fault(r, name: str, tiny: bool) -> str | None:
    """What makes `r` no record of the finding `name` that the page can take, in a few words
    (None: nothing): another finding's, the tiny model's where `tiny` is not asked for (or the
    other way round), a field of FIELDS missing or not what it must be, a term that is wrong
    (term_fault), or a headline that is not the first term's."""
    if not isinstance(r, dict):
        return "not a finding's record (a JSON object)"
    if r.get("finding") != name:
        return f"its finding is {r.get('finding')!r}, not {name!r} (the file's name)"
    if r.get("tiny") is not tiny:
        return ("not a run of the tiny model, as --tiny asked" if tiny else
                "a run of the tiny model (or one that does not say) is no record of the finding")
    for key, (kind, optional) in FIELDS.items():
        if not (optional and key not in r) and not KINDS[kind](r.get(key)):
            return f"{key} must be {kind}, not {r.get(key)!r}"
    if "terms" in r and not (isinstance(r["terms"], dict) and r["terms"]):
        return "terms must be a mapping of each term's name to the term, one term at least"
    for label, t in terms(r).items():
        why = term_fault(t, r["seeds"])
        if why:
            return f"term {label!r}: {why}"
    first = next(iter(terms(r).values()))
    differ = [k for k in HEADLINE if k in r and not same(r[k], first.get(k))]
    if differ:
        return f"its headline (the first term's numbers at the top) differs from the first " \
               f"term in {', '.join(differ)}"
    return None


def term_fault(t, seeds: int) -> str | None:
    """What is wrong with a term (None: nothing): not a record of one, its effect_by_seed not one
    number (or null) a seed, its claim malformed, or its effect, spread, interval, count of seeds
    and verdict not what common.term makes of its effect_by_seed and claim."""
    if not isinstance(t, dict):
        return "no record of a term"
    by_seed, margin = t.get("effect_by_seed"), t.get("margin")
    if not (isinstance(by_seed, list) and len(by_seed) == seeds and
            all(v is None or a_number(v) for v in by_seed)):
        return f"effect_by_seed must be a list of {seeds} numbers, one a seed (null: none)"
    if not isinstance(t.get("effect_name"), str):
        return "effect_name must be a text"
    if t.get("expect") not in EXPECT:
        return f"expect must be one of {EXPECT}, not {t.get('expect')!r}"
    if not (margin is None or a_number(margin) and margin >= 0):
        return f"margin must be a number of at least 0 (or null), not {margin!r}"
    if t.get("verdict") not in VERDICTS:
        return f"its verdict {t.get('verdict')!r} is none of {VERDICTS}"
    try:
        given = term(by_seed, t["expect"], t["effect_name"], margin)
    except ValueError as e:  # (a claim of no difference without its margin)
        return str(e)
    except OverflowError:
        return "its effects are too large to compute with"
    for key in RECOMPUTED:
        if not same(t.get(key), given[key]):
            return (f"its {key} {t.get(key)!r} is not what its effect_by_seed gives its claim "
                    f"({given[key]!r})")
    return None


def check_rerun(name: str, again) -> None:
    """Stop, in one line, at a rerun record the page cannot take: no record of the finding
    (check_record), an uncommitted tree's (or one without the commit it was made at: a finding's
    own --out copied), or one without its minutes."""
    path = RERUNS / f"{name}.json"
    check_record(path, again, name)
    made_at = again.get("rerun_commit")
    if not isinstance(made_at, str) or not re.fullmatch(r"[0-9a-f]{7,40}", made_at):
        raise SystemExit(f"error: {path}: rerun_commit {made_at!r} is no commit: a rerun of an "
                         f"uncommitted tree, or a record run_all.py did not write")
    if not (whole(again.get("rerun_minutes")) and 0 <= again["rerun_minutes"] < 10 ** 6):
        raise SystemExit(f"error: {path}: rerun_minutes {again.get('rerun_minutes')!r} is no "
                         f"count of minutes (or none): a record run_all.py did not write")


def utf8(text: str) -> bool:
    """Whether a file can hold `text` (JSON can hold a lone surrogate, "\\ud800"; UTF-8 cannot)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def one_line(row: str, head: str, source: Path) -> str:
    """A table's row as it is, if it is one line of the head's columns holding no table marker,
    in characters a file can hold: a line break (a "\\r" too: the page read back splits on it)
    would end the row, a "|" add a column, a marker move the table, a lone surrogate (JSON's
    "\\ud800") fail the page's write."""
    breaks = {"a line break": len(row.splitlines()) > 1,
              "a '|'": row.count("|") != head.count("|"),
              "a table marker": any(m in row for m in (BEGIN, END, RERUN_BEGIN, RERUN_END)),
              "a character no file holds": not utf8(row)}
    if any(breaks.values()):
        raise SystemExit(f"error: {source}: a field breaks the page's table: "
                         f"{', '.join(why for why, there in breaks.items() if there)} in its text")
    return row


def page_with_table(page: str, records: dict[str, dict], reruns: dict[str, dict]) -> str:
    """The page, its two tables written anew: the findings from their records, the rerun from
    the rerun's records (a rerun of a finding that has no record is refused)."""
    stray = sorted(set(reruns) - set(records))
    if stray:
        raise SystemExit(f"error: {RERUNS}: reruns of findings with no record: {stray}")
    unknown = sorted(set(records) - set(finding_names()))
    if unknown:
        raise SystemExit(f"error: {RECORDED}: records of no finding (no experiments/<name>.py): "
                         f"{unknown}")
    b, e, rb, re_ = (page.find(m) for m in (BEGIN, END, RERUN_BEGIN, RERUN_END))
    if min(b, e, rb, re_) >= 0 and not (e < rb or re_ < b):
        raise SystemExit(f"error: {PAGE}: one table's markers lie within the other's: the two "
                         f"tables must stand apart")
    findings = []
    for name, r in sorted(records.items()):
        path = RECORDED / f"{name}.json"
        check_record(path, r, name)
        findings.append(one_line(finding_row(name, r), TABLE_HEAD[0], path))
    for name, again in sorted(reruns.items()):
        check_rerun(name, again)
    reran = [one_line(rerun_row(name, records[name], again), RERUN_HEAD[0], RERUNS / f"{name}.json")
             for name, again in sorted(reruns.items())]
    return between(between(page, BEGIN, END, "\n".join(TABLE_HEAD + findings)), RERUN_BEGIN,
                   RERUN_END, "\n".join(RERUN_HEAD + reran))


def write_whole(path: Path, text: str) -> None:
    """`path` replaced by `text` whole, or left as it was: the text is written to a file of its
    own beside it first (a failed write, a full disk, touches only that). session.write_beside
    does the same for a run's files, but importing session loads torch (~4 s, for a page that is
    written in 0.1 s) and leaves its temporary file behind when a write fails."""
    fd, new = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".new")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(new, stat.S_IMODE(path.stat().st_mode))  # (mkstemp's file is its owner's only)
        os.replace(new, path)
    finally:
        if os.path.exists(new):
            os.unlink(new)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="findings (default: every one recorded)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model: the machinery only")
    parser.add_argument("--runs", help="where the reruns' runs go (default: a folder of this "
                        "commit's, so a stopped rerun goes on where it stopped and another commit "
                        "reruns all; with uncommitted changes, one of this rerun's own)")
    parser.add_argument("--table", action="store_true", help="write docs/findings.md's table "
                        "from docs/findings/*.json (and rerun nothing)")
    args = parser.parse_args()
    if args.table:
        try:
            write_whole(PAGE, page_with_table(PAGE.read_text(encoding="utf-8"), recorded(),
                                              recorded(RERUNS)))
        except OSError as e:  # (a page or folder that cannot be written: the page as it was)
            raise SystemExit(f"error: {PAGE}: {e.strerror or e}")
        print(f"wrote the tables of {PAGE}")
        return
    clean, start, made_at = committed(), tree(), commit()
    if not clean and args.runs:
        raise SystemExit("error: the tree has uncommitted changes (or no git): its reruns go to "
                         "a folder of their own, where no rerun of a commit looks; leave --runs "
                         "out, or commit")
    runs = Path(args.runs or ROOT / "out" / "experiments" / (
        f"rerun-{commit()}" if clean else
        f"rerun-{commit()}-uncommitted-{time.strftime('%Y%m%d-%H%M%S')}"))
    if not clean:
        print(f"the tree has uncommitted changes (or no git): every run made anew, in {runs}")
    names = args.names or finding_names()
    rows, records = list(RERUN_HEAD), recorded(RECORDED)
    for name in names:
        path = RECORDED / f"{name}.json"
        if name not in records:
            raise SystemExit(f"error: {name}: nothing recorded in {path}; run python "
                             f"experiments/{name}.py first")
        was = records[name]
        check_record(path, was, name)  # (before an hour of runs, not after)
        unchanged(start, f"{name} and the findings after it are not rerun")
        again, minutes = rerun(name, runs, args.tiny, clean)
        check_record(partial(runs) / f"{name}.json", again, name, args.tiny)
        unchanged(start, f"{name}'s rerun may have run the new code: its runs in {runs} "
                                f"are not reported")
        again = keep(name, again, runs, made_at + ("" if clean else " (uncommitted)"), minutes)
        rows.append(rerun_row(name, was, again))
        print(rows[-1], flush=True)
    print("\n".join(rows))
    print(f"the records: {runs / 'records'} " + ("(the tiny model's: the machinery only, not "
                                                 "for the page)" if args.tiny else
                                                 f"(for the page: copy them to {RERUNS}, then "
                                                 f"--table)"))


if __name__ == "__main__":
    main()
