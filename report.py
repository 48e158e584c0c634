"""report.html: one page to look at what a run did, built from its run folder alone.

Its curves, every step's samples token by token, its held-out problems at the first evaluation
and the last, its config and machine.

    python report.py out/grpo          # writes out/grpo/report.html (every run writes it at its end)

The page is one self-contained file: no server, no network, no script or font from elsewhere; it
opens from disk on a machine without internet. Here: what the page shows and how much of it
(every part within its budget of bytes, measured as the page writes it); charts.py draws the
curves (SVG), report_template.py holds the page's fixed HTML, its style and the script that
switches steps and colourings. Everything a run wrote -- prompts, completions, tool results,
even metric names -- is untrusted text (a dataset's, a model's): it reaches the page escaped, or
as JSON that the script puts into text nodes, never as markup.
"""

import argparse
import html
import json
import math
import os
import sys
from pathlib import Path

from charts import PANELS, every_point, points, svg_lines
from data import escaped, printable
from report_template import PAGE, SCRIPT, STEP_BROWSER, STYLE
from rollout_log import FILE as ROLLOUTS, DamagedLog, json_lines, records


# ---------------------------------------------------------------------------------------------
# The curves: the panels of curves.png, and a chart of any metric (charts.py draws them).


def curves_html(history: list[dict]) -> str:
    """The panels of curves.png, and a chart of any metric the run logged, to choose from -- as
    many as CURVES_BUDGET holds (a metric's name shortened past NAME characters)."""
    columns = every_point(history)
    first = ("reward", "accuracy", "eval_accuracy") if "reward" in columns else \
        tuple(k for k in ("loss", "eval_loss", "accuracy", "eval_accuracy", "eval_pair_accuracy")
              if k in columns)
    panels = [("reward and accuracy" if "reward" in first else "loss and held-out", first)]
    panels += [(name, keys) for name, keys in PANELS if any(k not in first for k in keys)]
    grid = [svg_lines([(k, columns.get(k, [])) for k in keys], name) for name, keys in panels]
    options, charts, used = [], [], 0
    for i, (k, p) in enumerate(sorted(columns.items())):
        option = f'<option value="{i}">{html.escape(short(k))}</option>'
        chart = f'<div class="one" data-i="{i}" hidden>{svg_lines([(short(k), p)], short(k))}</div>'
        used += size_of(option + chart)
        if used > CURVES_BUDGET:
            break
        options.append(option)
        charts.append(chart)
    left = (f'<p class="kept">{len(charts)} of the {len(columns)} metrics can be chosen here (the '
            f'page keeps {CURVES_BUDGET / 1e6:g} MB of charts); metrics.jsonl has every one.</p>') \
        if len(charts) < len(columns) else ""
    return (f'<div class="grid">{"".join(c for c in grid if c)}</div>'
            f'<p><label>any metric the run logged: <select id="metric">{"".join(options)}'
            f'</select></label></p>{left}<div id="metric-charts">{"".join(charts)}</div>')


# ---------------------------------------------------------------------------------------------
# report.html's budget: every text measured as the page writes it.

# How much a page keeps: under ~50 MB, a page opens in seconds and its data is one string
# JSON.parse takes (a GPU run of 512 samples a step passes V8's longest string, ~512 MB, within a
# few hundred steps: the step browser showed none). Bytes as written into the page: JSON writes
# "<" as \u003c (6 bytes), "é" as \u00e9 (6), "😀" as two (12); HTML "<" as &lt; (4), "😀" in 4.
# rollouts.jsonl and metrics.jsonl keep everything.
DATA_BUDGET = 40_000_000  # the samples of every step
STEP_BUDGET = DATA_BUDGET // 4  # one step's most: past it, its texts are shortened
HELDOUT_BUDGET = 4_000_000  # the held-out table
CURVES_BUDGET = 3_000_000  # the charts of any metric
TABLE_BUDGET = 200_000  # the config's table, and the machine's
STEP_TOKENS = 200_000  # a step's most tokens shown one by one: a span each, drawn whenever a
# step or a colouring is chosen (a million took 11 s to open)
MIN_TEXT = 400  # the least a shortened text keeps (its mark included) before samples go
NAME = 200  # characters of a name shown (a metric's, a reward source's, the title's parts)


def json_size(x) -> int:
    """Bytes of x in the page's JSON (ASCII: json.dumps escapes the rest)."""
    return len(page_json(x))


def html_size(text: str) -> int:
    """Bytes of text in the page's HTML, escaped."""
    return size_of(html.escape(text))


def size_of(page_text: str) -> int:
    """Bytes of a part of the page (a lone surrogate: U+FFFD's 3, see printable)."""
    return len(page_text.encode("utf-8", "surrogatepass"))


def clip(text: str, budget: int, size=json_size, whole: str = "rollouts.jsonl has the whole "
         "text") -> str:
    """text in at most `budget` bytes as the page writes it (size: json_size or html_size):
    whole where it fits, else its head and its tail around a mark that says how many characters
    are left out (budget >= MIN_TEXT: the mark fits)."""
    if len(text) * 12 + 2 <= budget or (len(text) <= budget and size(text) <= budget):
        return text  # (12: the most a character takes, "😀" as two JSON escapes)
    mark = lambda n: f" [... {n:,} characters left out here: {whole} ...] "  # noqa: E731
    room = max(budget - size(mark(len(text))), 0)  # (no count is longer than the whole length)
    head = _fits(text, room * 2 // 3, size)
    tail = _fits(text, room - size(text[:head]), size, from_end=True)
    return text[:head] + mark(len(text) - head - tail) + text[len(text) - tail:]


def _fits(text: str, budget: int, size, from_end: bool = False) -> int:
    """The most characters from text's start (or end) whose size is within budget: a search
    over at most `budget` of them (each takes a byte at least) that measures each character
    once on the way (a text's size is its characters' sizes, and its quotes: size(""))."""
    low, high, empty = 0, min(len(text), budget), size("")
    used = empty
    while low < high:
        mid = (low + high + 1) // 2
        more = size(text[len(text) - mid:len(text) - low] if from_end else text[low:mid]) - empty
        low, high, used = (mid, high, used + more) if used + more <= budget else \
            (low, mid - 1, used)
    return low


def level(sizes: list[int], room: int) -> float:
    """The largest cap c with sum(min(s, c) for s in sizes) <= room (inf: all fit whole): the
    texts under it stay whole, the longer ones are cut to it -- the room goes to the short first."""
    rest = len(sizes)
    for s in sorted(sizes):
        if s * rest > room:
            return room // rest
        room -= s
        rest -= 1
    return math.inf


def fit(units: list[tuple[int, list[int]]], budget: int) -> tuple[int, float]:
    """(n, cap): how many of `units` -- each (its fixed bytes, its texts' bytes), in the order
    the page shows them -- fit in `budget` bytes, and the cap on their texts: all of them whole
    where they fit; else the longest cut to one cap (level); else the first units whose texts
    fit at MIN_TEXT bytes each."""
    n, used = 0, 0
    for fixed, sizes in units:
        used += fixed + sum(min(s, MIN_TEXT) for s in sizes)
        if used > budget:
            break
        n += 1
    room = budget - sum(fixed for fixed, _ in units[:n])
    return n, level([s for _, sizes in units[:n] for s in sizes], room)


def text_of(x) -> str:
    """x as the page shows it: a string as it is, anything else as JSON (an object, a number)."""
    if isinstance(x, str):
        return x
    try:
        return json.dumps(x, ensure_ascii=False)
    except (ValueError, RecursionError):  # (nested deeper than the encoder goes from here)
        return "(nested too deeply to show here)"


def short(name) -> str:
    """A name (a metric's, a reward source's) in at most NAME characters."""
    name = text_of(name)
    return name if len(name) <= NAME else f"{name[:NAME]}… ({len(name):,} characters)"


# ---------------------------------------------------------------------------------------------
# report.html: the samples of every step, and the held-out problems.


def prompt_text(row: dict) -> str:
    prompt = row.get("problem") or row.get("prompt") or ""
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"{short(m.get('role'))}: {text_of(m.get('content'))}"
                         if isinstance(m, dict) else text_of(m) for m in prompt)
    return text_of(prompt)


def number(x) -> float | None:
    """A per-token value as a float (an integer past the largest float: its sign's infinity);
    null stays None."""
    if x is None:
        return None
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def token_series(r: dict) -> dict:
    """A detailed sample's colourings, one value (or null) per token: the advantage it carried,
    where the step's update moved its log-prob (new - old), the trainer's log-prob less the
    engine's, the entropy. A null in a list (a value the log did not keep) colours nothing."""
    t, n = r["tokens"], len(r["completion_ids"])

    def rounded(xs):
        return [None if x is None else round(x, 3) for x in map(number, xs)]

    def less(xs, ys):
        return rounded(None if x is None or y is None else x - y
                       for x, y in zip(map(number, xs), map(number, ys)))
    out = {}
    if "advantage" in t:  # ppo.py: one per token
        out["advantage"] = rounded(t["advantage"])
    elif r.get("advantage") is not None:
        out["advantage"] = rounded([r["advantage"]]) * n
    if "new_logprob" in t and "logprob" in t:
        out["change"] = less(t["new_logprob"], t["logprob"])
    if "engine_logprobs" in r and "logprob" in t:
        out["mismatch"] = less(t["logprob"], r["engine_logprobs"])
    if "entropy" in t:
        out["entropy"] = rounded(t["entropy"])
    if "mask" in r:  # the environment's tokens were not trained: no colour for them
        out = {k: [v if m else None for v, m in zip(vs, r["mask"])] for k, vs in out.items()}
    return out


def sample_view(r: dict) -> tuple[dict, dict]:
    """What the step browser shows of a train record: its group's prompt and answer, and the
    sample's figures and text (its tokens and their colourings where the log kept them); a text
    no step could hold whole already shortened (clip)."""
    answer, template = r["row"].get("answer"), r.get("tokens", {}).get("prompt")
    group = {"prompt": clip(prompt_text(r["row"]), STEP_BUDGET),
             "answer": None if answer is None else clip(text_of(answer), STEP_BUDGET),
             "template": None if template is None else clip(text_of(template), STEP_BUDGET)}
    sample = {"reward": r["reward"], "advantage": r.get("advantage"), "kept": r["kept"],
              "rewards": {short(k): v for k, v in r["rewards"].items()},
              "correct": r.get("correct"), "length": len(r["completion_ids"]),
              "truncated": r["truncated"], "text": clip(r["completion"], STEP_BUDGET)}
    if "tokens" in r:
        if "pieces" in r["tokens"]:
            sample["pieces"] = r["tokens"]["pieces"]
        sample["mask"] = r.get("mask")
        sample["series"] = token_series(r)
    return group, sample


def page_json(x) -> str:
    """x as the page holds it: JSON, its non-finite numbers as strings (for_json), and "<", ">"
    and "&" escaped -- inside <script> only "</" could end the element early."""
    text = json.dumps(for_json(x), separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def for_json(x):
    """x with its non-finite numbers as the strings "NaN", "Infinity" and "-Infinity": json.dumps
    writes them bare, which JSON.parse rejects (one NaN anywhere blanked the step browser)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if x != x else "Infinity" if x > 0 else "-Infinity"
    if isinstance(x, dict):
        return {k: for_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [for_json(v) for v in x]
    return x


def step_entry(step: int, views: list[tuple[int, dict, dict]]) -> dict:
    """One step of the browser from its samples' (group, group view, sample view)."""
    groups: dict[int, dict] = {}
    for index, group, sample in views:
        g = groups.setdefault(index, {**group, "index": index, "samples": []})
        g["template"] = g.get("template") or group.get("template")
        g["samples"].append(sample)
    for g in groups.values():
        g["samples"].sort(key=lambda x: -x["reward"])
    # The groups shown token by token first, then those that trained (an advantage not 0, or a
    # reward spread: ppo.py's advantages are per token), then the rest.
    order = sorted(groups.values(), key=lambda g: (not any("pieces" in x for x in g["samples"]),
                                                   len({x["reward"] for x in g["samples"]}) == 1
                                                   and not any(x.get("advantage")
                                                               for x in g["samples"]),
                                                   g["index"]))
    return {"step": step, "groups": order}


GROUP_TEXTS = ("prompt", "template", "answer")
TOKEN_FIELDS = ("pieces", "series", "mask")


def drawn_tokens(entry: dict) -> dict:
    """A step's entry whose samples show STEP_TOKENS tokens one by one at most, the first in the
    page's order; the samples past them as plain text, and a note that says how many."""
    groups, shown, plain = [], 0, 0
    for g in entry["groups"]:
        samples = []
        for x in g["samples"]:
            shown += len(x.get("pieces", ()))
            if "pieces" in x and shown > STEP_TOKENS:
                x, plain = {k: v for k, v in x.items() if k not in TOKEN_FIELDS}, plain + 1
            samples.append(x)
        groups.append({**g, "samples": samples})
    if not plain:
        return entry
    total = sum(len(g["samples"]) for g in groups)
    return {**entry, "groups": groups,
            "note": f"This step holds more tokens than the page draws one by one "
                    f"({STEP_TOKENS:,}): {plain:,} of its {total:,} samples shown as plain text; "
                    f"rollouts.jsonl has every token."}


def fit_step(entry: dict, budget: int) -> dict:
    """A step's entry in at most `budget` bytes of the page: whole where it fits; else without
    its token colours, its longest texts cut to one length where marked, and -- where even
    MIN_TEXT of each is too much -- its last samples left out; and a note that says which."""
    if json_size(entry) <= budget:
        return entry
    groups = [{**g, "samples": [{k: v for k, v in x.items() if k not in TOKEN_FIELDS}
                                for x in g["samples"]]} for g in entry["groups"]]
    units = []  # (a sample: its group's head with its first)
    for g in groups:
        head = {**g, **{k: "" for k in GROUP_TEXTS if g[k] is not None}, "samples": []}
        own = [g[k] for k in GROUP_TEXTS if g[k] is not None]
        for i, x in enumerate(g["samples"]):
            fixed = json_size({**x, "text": ""}) + 1 + (json_size(head) + 1 if i == 0 else 0)
            mine = [x["text"], *own] if i == 0 else [x["text"]]
            units.append((fixed, [json_size(t) for t in mine]))

    def note(n: int, cut: int) -> str:
        said = [f"This step's samples pass {budget / 1e6:.3g} MB: shown without token colours"]
        said += [f"{n:,} of its {len(units):,} samples (the rest left out)"] if n < len(units) \
            else []
        said += [f"{cut:,} texts shortened where marked"] if cut else []
        return "; ".join(said) + "; rollouts.jsonl has them whole."
    most = note(len(units) - 1, len(units) * 4)  # (no note is longer)
    n, cap = fit(units, budget - json_size({"step": entry["step"], "groups": [], "note": most}))
    cut = sum(size > cap for _, sizes in units[:n] for size in sizes)
    kept, i = [], 0
    for g in groups:
        samples = g["samples"][:max(n - i, 0)]
        i += len(g["samples"])
        if samples:
            kept.append({**g, **{k: g[k] if g[k] is None else clip(g[k], cap)
                                 for k in GROUP_TEXTS},
                         "samples": [{**x, "text": clip(x["text"], cap)} for x in samples]})
    return {"step": entry["step"], "groups": kept, "note": note(n, cut)}


def steps_kept(sizes: dict[int, int], budget: int) -> list[int]:
    """The steps whose samples a page keeps: all that fit in `budget`; past it, the last, the
    first, then steps ever more finely spread between, while they fit."""
    steps = sorted(sizes)
    if sum(sizes.values()) <= budget:
        return steps
    kept, used, n, k = set(), 0, len(steps), 2
    order = [n - 1, 0]
    while k < 4 * n:  # the middle, the quarters, the eighths...: every index by k >= 2n
        order += [round(j * (n - 1) / k) for j in range(1, k, 2)]
        k *= 2
    for i in order:
        if steps[i] not in kept and used + sizes[steps[i]] <= budget:
            kept.add(steps[i])
            used += sizes[steps[i]]
    return sorted(kept)


def read_samples(path, said=print) -> tuple[list[dict], list[dict], str]:
    """The step browser's steps from a rollouts.jsonl, read twice, a record at a time (a GPU
    run's log is gigabytes): once to size each step, once to keep those that fit (steps_kept:
    a step past its share counts as that share, what fit_step makes of it); the held-out records
    of the first and the last evaluation; a line that says what the page left out ("" when
    nothing)."""
    sizes, groups, first, last = {}, {}, [], []
    for _, _, r in records(path, said=said):
        if r["kind"] == "eval":
            if not first or r["step"] < first[0]["step"]:
                first = [r]
            elif r["step"] == first[0]["step"]:
                first.append(r)
            if not last or r["step"] > last[0]["step"]:
                last = [r]
            elif r["step"] == last[0]["step"]:
                last.append(r)
            continue
        group, sample = sample_view(r)
        shown = groups.setdefault(r["step"], {})  # group -> its template counted yet
        size = json_size(sample) + 1
        if r["group"] not in shown:
            size += json_size({**group, "template": None, "index": r["group"], "samples": []}) + 1
        if group.get("template") and not shown.get(r["group"]):
            size += json_size(group["template"])
        shown[r["group"]] = shown.get(r["group"]) or bool(group.get("template"))
        if r["step"] not in sizes:  # (its entry's own bytes, and a comma)
            sizes[r["step"]] = json_size({"step": r["step"], "groups": []}) + 1
        sizes[r["step"]] += size
    steps, used = [], json_size({"steps": []})
    most = STEP_BUDGET - 16  # (four such steps, their commas and {"steps":[]}: DATA_BUDGET)
    kept = steps_kept({s: min(size, most) for s, size in sizes.items()}, DATA_BUDGET - used)
    views: dict[int, list] = {s: [] for s in kept}
    if kept:
        for _, _, r in records(path, said=lambda _: None):
            if r["kind"] == "train" and r["step"] in views:
                views[r["step"]].append((r["group"], *sample_view(r)))
    for s in kept:
        entry = fit_step(drawn_tokens(step_entry(s, views.pop(s))), most - 1)  # (- its comma)
        size = json_size(entry) + 1
        if used + size <= DATA_BUDGET:  # (always, by the sizes steps_kept took: upper bounds)
            steps.append(entry)
            used += size
    lines = []
    if len(steps) < len(sizes):
        lines.append(f"This page keeps the samples of {len(steps)} of its {len(sizes)} steps -- "
                     f"the first, the last and steps spread evenly between -- to stay under "
                     f"{DATA_BUDGET / 1e6:g} MB; the curves cover every step, and rollouts.jsonl "
                     f"holds every sample.")
    if any("note" in s for s in steps):
        lines.append(f"Steps whose samples pass {STEP_BUDGET / 1e6:g} MB show no token colours, "
                     f"and where that is not enough, texts shortened where marked; steps of more "
                     f"than {STEP_TOKENS:,} tokens colour their first (each such step says so).")
    evals = first + (last if last and last[0]["step"] != first[0]["step"] else [])
    return steps, evals, " ".join(lines)


def held_out_html(evals: list[dict]) -> str:
    """Each held-out problem at the first evaluation and at the last: what changed first; as
    much of them as HELDOUT_BUDGET holds (fit), and what it left out said."""
    if not evals:
        return "<p>No held-out samples in this run's log.</p>"
    first, last = min(r["step"] for r in evals), max(r["step"] for r in evals)
    before = {(r["id"], r.get("sample", 0)): r for r in evals if r["step"] == first}
    after = {(r["id"], r.get("sample", 0)): r for r in evals if r["step"] == last}
    keys = [k for k in before if k in after]
    right = lambda r: bool(r["correct"])  # noqa: E731  (evaluate.py writes true or false)
    keys.sort(key=lambda k: (right(before[k]) == right(after[k]), right(after[k])))
    mark = lambda r: "✓" if right(r) else "✗"  # noqa: E731

    def row(k, problem, answer, old, new):
        changed = "changed" if right(before[k]) != right(after[k]) else ""
        return (f'<tr class="{changed}"><td><div class="cell">{html.escape(problem)}<br><small>'
                f'answer {html.escape(answer)}</small></div></td><td><div class="cell"><b>'
                f'{mark(before[k])}</b> {html.escape(old)}</div></td><td><div class="cell"><b>'
                f'{mark(after[k])}</b> {html.escape(new)}</div></td></tr>')
    texts = [[text_of(before[k].get("problem") or k[0]), text_of(before[k].get("answer")),
              before[k]["completion"], after[k]["completion"]] for k in keys]
    changed = sum(right(before[k]) != right(after[k]) for k in keys)
    acc = lambda side: sum(right(side[k]) for k in keys) / max(len(keys), 1)  # noqa: E731
    head = (f'<p>{len(keys)} problems; correct {acc(before):.1%} at step {first}, {acc(after):.1%} '
            f'at step {last}; {changed} changed (first in the table).</p>')
    table = (f'<div class="scroll"><table id="heldout-table"><tr><th>problem</th>'
             f'<th>step {first}</th><th>step {last}</th></tr>')

    def note(n: int, cut: int) -> str:
        left = [f"{cut:,} texts shortened where marked"] if cut else []
        left += [f"{len(keys) - n:,} problems left out (the last in this order)"] \
            if n < len(keys) else []
        return (f'<p class="kept">The page keeps {HELDOUT_BUDGET / 1e6:g} MB of them: '
                f'{", ".join(left)}; rollouts.jsonl has every one.</p>') if left else ""
    units = [(size_of(row(k, "", "", "", "")), [html_size(t) for t in cells])
             for k, cells in zip(keys, texts)]
    most = size_of(head + note(len(keys) - 1, 4 * len(keys)) + table + "</table></div>")
    n, cap = fit(units, HELDOUT_BUDGET - most)  # (most: all but the rows, steps of any length)
    rows = [row(k, *(clip(t, cap, html_size) for t in cells))
            for k, cells in zip(keys[:n], texts)]
    cut = sum(size > cap for _, sizes in units[:n] for size in sizes)
    return f'{head}{note(n, cut)}{table}{"".join(rows)}</table></div>'


def table_html(d: dict, source: str) -> str:
    """A config's or a machine's entries, as many as TABLE_BUDGET holds, each value shortened
    past a fiftieth of it."""
    rows, used = [], 0
    for i, (k, v) in enumerate(d.items()):
        value = clip(text_of(v), TABLE_BUDGET // 50, html_size, f"{source} has it whole")
        row = f"<tr><th>{html.escape(short(k))}</th><td>{html.escape(value)}</td></tr>"
        used += size_of(row)
        if used > TABLE_BUDGET:
            rows.append(f'<tr><td colspan="2" class="kept">{len(d) - i:,} more entries: '
                        f'{html.escape(source)} has them</td></tr>')
            break
        rows.append(row)
    return "<table>" + "".join(rows) + "</table>"


# ---------------------------------------------------------------------------------------------
# The page.


def write_report(out) -> Path:
    """<out>/report.html from the run folder alone: metrics.jsonl, rollouts.jsonl (where the run
    has one), its *_config.json and machine.json. A cut last line (a killed write) of either log
    is left out, and said; other damage stops here in one line."""
    out = Path(out)
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"error: {escaped(out)}: no metrics.jsonl there (a run's --out folder)")
    notes = []
    try:
        history = [r for _, _, r in json_lines(metrics, notes.append)]
        steps, evals, kept = read_samples(out / ROLLOUTS, notes.append) \
            if (out / ROLLOUTS).is_file() else ([], [], "")
    except DamagedLog as e:
        raise SystemExit(f"error: {e}") from None
    for note in notes:
        print(escaped(note))
    configs = sorted(out.glob("*_config.json"))
    config = read_object(configs[0]) if configs else {}
    machine = read_object(out / "machine.json")
    data = page_json({"steps": steps})
    title = f"{out.name}: {short(config.get('model', ''))} on {short(config.get('data', ''))}"
    accuracy = points(history, "eval_accuracy")
    summary = f"{len(history)} records in metrics.jsonl"
    if len(accuracy) > 1:
        summary += (f"; held-out accuracy {accuracy[0][1]:.1%} at step {accuracy[0][0]:g}, "
                    f"{accuracy[-1][1]:.1%} at step {accuracy[-1][0]:g}")
    summary = " ".join([summary + ".", *(n + "." for n in notes)])
    browser = ('<p>No rollouts in this folder (rollouts.jsonl is written by grpo.py, ppo.py and '
               'distill.py).</p>') if not steps else \
        (f'<p id="kept" class="kept">{html.escape(kept)}</p>' if kept else '') + STEP_BROWSER
    page = PAGE.format(title=html.escape(title), summary=html.escape(summary), style=STYLE,
                       curves=curves_html(history), browser=browser,
                       heldout=held_out_html(evals),
                       config=table_html(config, configs[0].name if configs else ""),
                       machine=table_html(machine, "machine.json"), data=data, script=SCRIPT)
    path, tmp = out / "report.html", out / ".report.html.tmp"
    tmp.unlink(missing_ok=True)
    with open(tmp, "x", encoding="utf-8") as f:  # (a new file: no link there is followed)
        f.write(printable(page))
    os.replace(tmp, path)  # (a link at report.html is replaced, never written through)
    return path


def read_object(path: Path) -> dict:
    """A JSON object from a file the report shows (a config, machine.json); {} where it is
    missing, no file (a FIFO would be waited on forever) or no JSON object."""
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a run's output folder (--out of any smolrl component)")
    args = parser.parse_args(argv)
    path = write_report(args.run)
    print(escaped(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB); open it in a browser"))


if __name__ == "__main__":
    sys.exit(main())
