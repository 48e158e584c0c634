"""A run's pictures: curves.png, a small grid of its curves, and report.html, one page to look at
what the run did -- its curves, every step's samples token by token, its held-out problems at
the first evaluation and the last, its config and machine.

    python report.py out/grpo          # writes out/grpo/report.html (every run writes it at its end)

The page is one self-contained file: no server, no network, no script or font from elsewhere; it
opens from disk on a machine without internet. The curves are SVG drawn here; a few lines of
script switch steps and colourings. Everything a run wrote -- prompts, completions, tool results,
even metric names -- is untrusted text (a dataset's, a model's): it reaches the page escaped, or as
JSON that the script puts into text nodes, never as markup.
"""

import argparse
import html
import json
import math
import sys
from pathlib import Path

from rollout_log import FILE as ROLLOUTS, read_rollouts

# The grid's panels after the first (the algorithm's own: its reward or loss and held-out
# figures): a title and the metrics drawn in it, where the run logged them.
PANELS = [
    ("loss and KL", ("loss", "kl", "value_loss", "reverse_kl")),
    ("entropy (nats per token)", ("entropy_trained",)),
    ("completion length (tokens)", ("completion_len", "eval_completion_len")),
    ("truncated, clipped (fraction)", ("truncated_frac", "clip_low", "clip_high")),
    ("seconds per phase", ("gen_seconds", "reward_seconds", "train_seconds", "sync_seconds",
                           "eval_seconds")),
]
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def points(history: list[dict], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))
            and not isinstance(r.get(key), bool) and math.isfinite(r[key])]


# ---------------------------------------------------------------------------------------------
# curves.png


def plot_curves(history: list[dict], path, title: str = "",
                train_keys=("reward", "accuracy"), eval_keys=("eval_accuracy",),
                stage_bounds=(), loss_keys=()) -> None:
    """The run's curves in one PNG: first train_keys per step and the held-out eval_keys (a
    dashed line where each stage of a staged run ends; loss_keys, no fraction of 1, on a second
    axis on the right), then a panel for each group of PANELS the run logged."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    shown = set(train_keys) | set(eval_keys) | set(loss_keys)
    panels = [(name, [k for k in keys if k not in shown and points(history, k)])
              for name, keys in PANELS]
    panels = [(name, keys) for name, keys in panels if keys]
    cols = 1 if not panels else 2
    rows = -(-(1 + len(panels)) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 if cols == 1 else 11, 4 if rows == 1
                                                  else 2.9 * rows), squeeze=False)
    ax = axes[0][0]
    for key in train_keys:
        if points(history, key):
            ax.plot(*zip(*points(history, key)), label=f"train {key}", alpha=0.6)
    for key, color in zip(eval_keys, ("black", "tab:red", "tab:green")):
        if points(history, key):
            ax.plot(*zip(*points(history, key)), "o-", color=color,
                    label=f"held-out {key.removeprefix('eval_')}")
    for bound in stage_bounds:
        ax.axvline(bound, color="gray", linestyle="--", linewidth=1)
    ax.set_ylim(-0.02, 1.02)
    handles = ax.get_legend_handles_labels()
    if loss_keys:
        right = ax.twinx()
        for key, style in zip(loss_keys, ("-", "s--")):
            if points(history, key):
                right.plot(*zip(*points(history, key)), style, color="tab:purple", alpha=0.7,
                           label=key)
        right.set_ylabel("loss (nats per token)")
        right.set_ylim(bottom=0)
        handles = [a + b for a, b in zip(handles, right.get_legend_handles_labels())]
    ax.legend(*handles, fontsize=8)
    ax.set_title(title, fontsize=9)
    for i, (name, keys) in enumerate(panels, 1):
        ax = axes[i // cols][i % cols]
        for key, color in zip(keys, COLOURS):
            ax.plot(*zip(*points(history, key)), ".-", color=color, label=key, alpha=0.8)
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    for i in range(1 + len(panels), rows * cols):
        axes[i // cols][i % cols].axis("off")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
            ax.set_xlabel("step", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# report.html: the curves, as SVG.


def svg_chart(history: list[dict], keys, title: str, width=330, height=190) -> str:
    """One panel: a line per key (escaped names), the y range from the data, min and max
    labelled."""
    series = [(k, points(history, k)) for k in keys]
    series = [(k, p) for k, p in series if p]
    if not series:
        return ""
    xs = [x for _, p in series for x, _ in p]
    ys = [y for _, p in series for _, y in p]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    x1 = x1 if x1 > x0 else x0 + 1
    left, top, right, bottom = 42, 22, width - 8, height - 40
    sx = lambda x: left + (x - x0) / (x1 - x0) * (right - left)  # noqa: E731
    sy = lambda y: bottom - (y - y0) / (y1 - y0) * (bottom - top)  # noqa: E731
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="{left}" y="14" class="title">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
             f'class="frame"/>',
             f'<text x="{left - 4}" y="{top + 4}" class="tick" text-anchor="end">{y1:.3g}</text>',
             f'<text x="{left - 4}" y="{bottom}" class="tick" text-anchor="end">{y0:.3g}</text>',
             f'<text x="{left}" y="{bottom + 12}" class="tick">{x0:g}</text>',
             f'<text x="{right}" y="{bottom + 12}" class="tick" text-anchor="end">step {x1:g}'
             f'</text>']
    for i, (key, p) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}" '
                     f'stroke-width="1.6"><title>{html.escape(key)}</title></polyline>')
        if len(p) == 1:
            parts.append(f'<circle cx="{sx(p[0][0]):.1f}" cy="{sy(p[0][1]):.1f}" r="2.5" '
                         f'fill="{colour}"/>')
        parts.append(f'<text x="{left + 4 + 160 * (i % 2)}" y="{bottom + 26 + 11 * (i // 2)}" '
                     f'class="key" fill="{colour}">{html.escape(key)} '
                     f'({p[-1][1]:.3g})</text>')
    return "".join(parts) + "</svg>"


def curves_html(history: list[dict]) -> str:
    first = ("reward", "accuracy", "eval_accuracy") if points(history, "reward") else \
        tuple(k for k in ("loss", "eval_loss", "accuracy", "eval_accuracy", "eval_pair_accuracy")
              if points(history, k))
    grid = [svg_chart(history, first, "reward and accuracy" if "reward" in first else
                      "loss and held-out")]
    grid += [svg_chart(history, keys, name) for name, keys in PANELS
             if any(k not in first for k in keys)]
    every = sorted({k for r in history for k in r if k != "step" and points(history, k)})
    options = "".join(f'<option value="{i}">{html.escape(k)}</option>'
                      for i, k in enumerate(every))
    charts = "".join(f'<div class="one" data-i="{i}" hidden>{svg_chart(history, (k,), k)}</div>'
                     for i, k in enumerate(every))
    return (f'<div class="grid">{"".join(c for c in grid if c)}</div>'
            f'<p><label>any metric the run logged: <select id="metric">{options}</select></label>'
            f'</p><div id="metric-charts">{charts}</div>')


# ---------------------------------------------------------------------------------------------
# report.html: the samples of every step, and the held-out problems.


def prompt_text(row: dict) -> str:
    prompt = row.get("problem") or row.get("prompt") or ""
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
    return str(prompt)


def token_series(r: dict) -> dict:
    """A detailed sample's colourings, one value (or null) per token: the advantage it carried,
    where the step's update moved its log-prob (new - old), the trainer's log-prob less the
    engine's, the entropy."""
    t, n = r["tokens"], len(r["completion_ids"])

    def rounded(xs):
        return [None if x is None else round(x, 3) for x in xs]
    out = {}
    if "advantage" in t:  # ppo.py: one per token
        out["advantage"] = rounded(t["advantage"])
    elif r.get("advantage") is not None:
        out["advantage"] = [round(r["advantage"], 3)] * n
    if "new_logprob" in t and "logprob" in t:
        out["change"] = rounded(b - a for a, b in zip(t["logprob"], t["new_logprob"]))
    if "engine_logprobs" in r and "logprob" in t:
        out["mismatch"] = rounded(a - b for a, b in zip(t["logprob"], r["engine_logprobs"]))
    if "entropy" in t:
        out["entropy"] = rounded(t["entropy"])
    if "mask" in r:  # the environment's tokens were not trained: no colour for them
        out = {k: [v if m else None for v, m in zip(vs, r["mask"])] for k, vs in out.items()}
    return out


def steps_data(train: list[dict]) -> list[dict]:
    """What the step browser shows: per step, its groups, each sample's figures and text (its
    tokens and their colourings where the log kept them)."""
    steps: dict[int, dict] = {}
    for r in train:
        step = steps.setdefault(r["step"], {"step": r["step"], "groups": {}})
        group = step["groups"].setdefault(r["group"], {"prompt": prompt_text(r["row"]),
                                                       "answer": r["row"].get("answer"),
                                                       "samples": []})
        sample = {"reward": r["reward"], "advantage": r.get("advantage"), "kept": r["kept"],
                  "rewards": r["rewards"], "correct": r.get("correct"),
                  "length": len(r["completion_ids"]), "truncated": r["truncated"],
                  "text": r["completion"]}
        if "tokens" in r:
            sample["pieces"] = r["tokens"]["pieces"]
            sample["mask"] = r.get("mask")
            sample["series"] = token_series(r)
            group["template"] = r["tokens"].get("prompt")
        group["samples"].append(sample)
    out = []
    for s in sorted(steps):
        groups = []
        for index, g in steps[s]["groups"].items():
            g["index"] = index
            g["samples"].sort(key=lambda x: -x["reward"])
            groups.append(g)
        # The groups shown token by token first, then those with a reward spread (they trained),
        # then the rest (all samples alike: advantage 0).
        groups.sort(key=lambda g: (not any("pieces" in x for x in g["samples"]),
                                   len({x["reward"] for x in g["samples"]}) == 1, g["index"]))
        out.append({"step": s, "groups": groups})
    return out


def held_out_html(evals: list[dict]) -> str:
    """Each held-out problem at the first evaluation and at the last: what changed first."""
    if not evals:
        return "<p>No held-out samples in this run's log.</p>"
    first, last = min(r["step"] for r in evals), max(r["step"] for r in evals)
    before = {(r["id"], r.get("sample", 0)): r for r in evals if r["step"] == first}
    after = {(r["id"], r.get("sample", 0)): r for r in evals if r["step"] == last}
    keys = [k for k in before if k in after]
    keys.sort(key=lambda k: (before[k]["correct"] == after[k]["correct"], after[k]["correct"]))
    mark = lambda r: "✓" if r["correct"] else "✗"  # noqa: E731
    rows = [f'<tr class="{"changed" if before[k]["correct"] != after[k]["correct"] else ""}">'
            f'<td>{html.escape(str(before[k].get("problem") or k[0]))}<br>'
            f'<small>answer {html.escape(str(before[k].get("answer")))}</small></td>'
            f'<td><b>{mark(before[k])}</b> {html.escape(str(before[k]["completion"]))}</td>'
            f'<td><b>{mark(after[k])}</b> {html.escape(str(after[k]["completion"]))}</td></tr>'
            for k in keys]
    changed = sum(before[k]["correct"] != after[k]["correct"] for k in keys)
    acc = lambda side: sum(side[k]["correct"] for k in keys) / max(len(keys), 1)  # noqa: E731
    return (f'<p>{len(keys)} problems; correct {acc(before):.1%} at step {first}, {acc(after):.1%} '
            f'at step {last}; {changed} changed (first in the table).</p>'
            f'<div class="scroll"><table id="heldout-table"><tr><th>problem</th>'
            f'<th>step {first}</th><th>step {last}</th></tr>{"".join(rows)}</table></div>')


def table_html(d: dict) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}"
                               f"</td></tr>" for k, v in d.items()) + "</table>"


# ---------------------------------------------------------------------------------------------
# The page.


def write_report(out) -> Path:
    """<out>/report.html from the run folder alone: metrics.jsonl, rollouts.jsonl (where the run
    has one), its *_config.json and machine.json."""
    out = Path(out)
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"error: {out}: no metrics.jsonl there (a run's --out folder)")
    history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = read_rollouts(out) if (out / ROLLOUTS).is_file() else []
    config = next((json.loads(p.read_text()) for p in sorted(out.glob("*_config.json"))), {})
    machine = json.loads((out / "machine.json").read_text()) \
        if (out / "machine.json").is_file() else {}
    steps = steps_data([r for r in records if r["kind"] == "train"])
    data = json.dumps({"steps": steps}, separators=(",", ":"))
    # Inside <script> only "</" could end the element early: JSON escapes keep it data.
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = f"{out.name}: {config.get('model', '')} on {config.get('data', '')}"
    last = next((r for r in reversed(history) if "eval_accuracy" in r), None)
    summary = f"{len(history)} records in metrics.jsonl"
    if last is not None and "eval_accuracy" in history[0]:
        summary += (f"; held-out accuracy {history[0]['eval_accuracy']:.1%} at step "
                    f"{history[0]['step']}, {last['eval_accuracy']:.1%} at step {last['step']}")
    browser = ('<p>No rollouts in this folder (rollouts.jsonl is written by grpo.py, ppo.py and '
               'distill.py).</p>') if not steps else STEP_BROWSER
    page = PAGE.format(title=html.escape(title), summary=html.escape(summary), style=STYLE,
                       curves=curves_html(history), browser=browser,
                       heldout=held_out_html([r for r in records if r["kind"] == "eval"]),
                       config=table_html(config), machine=table_html(machine), data=data,
                       script=SCRIPT)
    path = out / "report.html"
    path.write_text(page)
    return path


STEP_BROWSER = """
<div class="controls">
 <button id="prev" type="button">&larr;</button>
 <label>step <select id="step"></select></label>
 <button id="next" type="button">&rarr;</button>
 <label>colour tokens by <select id="colour">
  <option value="advantage">advantage</option>
  <option value="change">log-prob change (after the update &minus; before)</option>
  <option value="mismatch">trainer &minus; engine log-prob</option>
  <option value="entropy">entropy</option>
 </select></label>
 <span id="scale"></span>
</div>
<p class="legend"><span class="tok pos">positive</span> <span class="tok neg">negative</span>
<span class="tok env">tool result: not trained</span> <span class="prompt-key">prompt: not
trained</span>. Each group's samples sorted by reward; per-token colours for the samples the log
kept in detail (--rollout-tokens: first), plain text for the rest. Hover a token for its value.</p>
<div id="groups"></div>
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{style}</style></head>
<body>
<h1>{title}</h1>
<p>{summary}</p>
<nav><a href="#curves">curves</a> · <a href="#samples">samples</a> ·
<a href="#heldout">held-out</a> · <a href="#run">config and machine</a></nav>
<section id="curves"><h2>Curves</h2>{curves}</section>
<section id="samples"><h2>Samples, step by step</h2>{browser}</section>
<section id="heldout"><h2>Held-out problems: first and last evaluation</h2>{heldout}</section>
<section id="run"><h2>Config and machine</h2><div class="two">{config}{machine}</div></section>
<script type="application/json" id="data">{data}</script>
<script>{script}</script>
</body></html>
"""

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;padding:0 12px 40px;max-width:1400px;
color:#222}
h1{font-size:20px;margin:16px 0 4px}h2{font-size:17px;border-bottom:1px solid #ddd;margin-top:28px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:10px}
.chart{width:100%;height:auto;background:#fff}.chart .frame{fill:#fafafa;stroke:#ccc}
.chart .title{font-size:12px;font-weight:600}.chart .tick{font-size:9px;fill:#555}
.chart .key{font-size:9px}.one{max-width:520px}
.controls{display:flex;flex-wrap:wrap;gap:8px;align-items:center;margin:8px 0}
.group{border:1px solid #ddd;border-radius:6px;margin:12px 0;padding:8px}
.prompt{white-space:pre-wrap;color:#666;background:#f3f3f3;padding:6px;border-radius:4px;
margin:0 0 6px;font-size:12px;max-height:9em;overflow:auto}
.samples{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:8px}
.sample{border:1px solid #e4e4e4;border-radius:4px;padding:6px;min-width:0}
.sample.dropped{opacity:.55}.head{font-size:12px;color:#444;margin-bottom:4px}
.text{white-space:pre-wrap;word-break:break-word;font:12px/1.5 ui-monospace,monospace}
.tok{border-radius:2px;box-shadow:inset -1px 0 0 rgba(255,255,255,.9)}.tok.env{background:#ddd;color:#555;font-style:italic;
outline:1px dashed #aaa}
.tok.pos{background:rgb(255,150,150)}.tok.neg{background:rgb(150,150,255)}
.prompt-key{background:#f3f3f3;color:#666;padding:0 3px}
.scroll{overflow-x:auto}table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #e0e0e0;padding:3px 6px;vertical-align:top;text-align:left}
tr.changed td{background:#fff8e0}#heldout-table td{white-space:pre-wrap;word-break:break-word;
max-width:420px}.two{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
"""

# The step browser. Run text only ever becomes a text node (textContent), never markup.
SCRIPT = r"""
(function () {
  var metric = document.getElementById('metric');
  function showMetric() {
    document.querySelectorAll('#metric-charts .one').forEach(function (d) {
      d.hidden = d.getAttribute('data-i') !== metric.value;
    });
  }
  if (metric) { metric.addEventListener('change', showMetric); showMetric(); }
  var data = JSON.parse(document.getElementById('data').textContent);
  var stepSel = document.getElementById('step');
  if (!stepSel || !data.steps.length) { return; }
  var colourSel = document.getElementById('colour');
  data.steps.forEach(function (s, i) {
    var o = document.createElement('option');
    o.value = String(i); o.textContent = String(s.step); stepSel.appendChild(o);
  });
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function colour(v, scale, kind) {
    if (v === null || v === undefined || !scale) { return ''; }
    var a = Math.min(Math.abs(v) / scale, 1);
    var fade = Math.round(255 * (1 - 0.75 * a));
    if (kind === 'entropy') { return 'rgb(255, 255, ' + fade + ')'; }
    return v > 0 ? 'rgb(255, ' + fade + ', ' + fade + ')' :
      v < 0 ? 'rgb(' + fade + ', ' + fade + ', 255)' : '';
  }
  function fmt(x) { return (x === null || x === undefined) ? '–' : Number(x).toFixed(3); }
  function render() {
    var step = data.steps[Number(stepSel.value)], kind = colourSel.value, scale = 0;
    step.groups.forEach(function (g) { g.samples.forEach(function (s) {
      ((s.series || {})[kind] || []).forEach(function (v) {
        if (v !== null) { scale = Math.max(scale, Math.abs(v)); }
      });
    }); });
    document.getElementById('scale').textContent = scale ?
      'full colour at |' + kind + '| = ' + scale.toFixed(3) : 'no ' + kind + ' in this step';
    var root = document.getElementById('groups');
    root.textContent = '';
    step.groups.forEach(function (g) {
      var box = el('div', 'group');
      box.appendChild(el('div', 'head', 'group ' + g.index + (g.answer !== null &&
        g.answer !== undefined ? ' · answer ' + g.answer : '')));
      box.appendChild(el('pre', 'prompt', g.template || g.prompt));
      var grid = el('div', 'samples');
      g.samples.forEach(function (s) {
        var card = el('div', 'sample' + (s.kept ? '' : ' dropped'));
        var head = 'reward ' + fmt(s.reward) + ' · advantage ' + fmt(s.advantage) + ' · ' +
          s.length + ' tokens' + (s.truncated ? ' · truncated' : '') + (s.kept ? '' : ' · dropped');
        Object.keys(s.rewards || {}).forEach(function (k) {
          head += ' · ' + k + ' ' + fmt(s.rewards[k]);
        });
        card.appendChild(el('div', 'head', head));
        var text = el('div', 'text');
        if (s.pieces) {
          var values = (s.series || {})[kind] || [];
          s.pieces.forEach(function (p, i) {
            var t = el('span', 'tok', p);
            if (s.mask && !s.mask[i]) {
              t.className = 'tok env'; t.title = 'tool result: not trained';
            } else {
              var v = values[i];
              t.style.backgroundColor = colour(v, scale, kind);
              if (v !== null && v !== undefined) { t.setAttribute('data-v', String(v)); }
              t.title = kind + ' ' + fmt(v);
            }
            text.appendChild(t);
          });
        } else {
          text.textContent = s.text;
        }
        card.appendChild(text);
        grid.appendChild(card);
      });
      box.appendChild(grid);
      root.appendChild(box);
    });
  }
  function go(d) {
    var i = Math.min(Math.max(Number(stepSel.value) + d, 0), data.steps.length - 1);
    stepSel.value = String(i); render();
  }
  stepSel.addEventListener('change', render);
  colourSel.addEventListener('change', render);
  document.getElementById('prev').addEventListener('click', function () { go(-1); });
  document.getElementById('next').addEventListener('click', function () { go(1); });
  render();
})();
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a run's output folder (--out of any smolrl component)")
    args = parser.parse_args(argv)
    path = write_report(args.run)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB); open it in a browser")


if __name__ == "__main__":
    sys.exit(main())
