"""report.html's template, the part of the page that is the same for every run: its HTML skeleton
(PAGE, filled in by report.write_report), the step browser's controls (STEP_BROWSER), the style
sheet (STYLE) and the script (SCRIPT) that switches steps, colourings and the chart of any metric.
All of it is written into the page itself: nothing is fetched, so the page opens offline. The
script puts a run's text into the page as text nodes only (textContent), never as markup.
"""

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
<p id="step-note" class="kept" hidden></p>
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
h1{font-size:20px;margin:16px 0 4px}h1,p,.head{overflow-wrap:anywhere}select{max-width:100%}
h2{font-size:17px;border-bottom:1px solid #ddd;margin-top:28px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:10px}
.chart{width:100%;height:auto;background:#fff}.chart .frame{fill:#fafafa;stroke:#ccc}
.chart .title{font-size:12px;font-weight:600}.chart .tick{font-size:9px;fill:#555}
.chart .key{font-size:9px}.one{max-width:520px}
.controls{display:flex;flex-wrap:wrap;gap:8px;align-items:center;margin:8px 0}
.group{border:1px solid #ddd;border-radius:6px;margin:12px 0;padding:8px}
.prompt{white-space:pre-wrap;color:#666;background:#f3f3f3;padding:6px;border-radius:4px;
margin:0 0 6px;font-size:12px;max-height:9em;overflow:auto;overflow-wrap:anywhere}
.samples{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:8px}
.sample{border:1px solid #e4e4e4;border-radius:4px;padding:6px;min-width:0}
.sample.dropped{opacity:.55}.head{font-size:12px;color:#444;margin-bottom:4px}
.text{white-space:pre-wrap;word-break:break-word;font:12px/1.5 ui-monospace,monospace}
.tok{border-radius:2px;box-shadow:inset -1px 0 0 rgba(255,255,255,.9)}.tok.env{background:#ddd;color:#555;font-style:italic;
outline:1px dashed #aaa}
.tok.pos{background:rgb(255,150,150)}.tok.neg{background:rgb(150,150,255)}
.prompt-key{background:#f3f3f3;color:#666;padding:0 3px}
.kept{background:#fff8e0;border:1px solid #e8d9a8;border-radius:4px;padding:6px}
.scroll{overflow-x:auto}table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #e0e0e0;padding:3px 6px;vertical-align:top;text-align:left}
td{overflow-wrap:anywhere}
tr.changed td{background:#fff8e0}#heldout-table td{white-space:pre-wrap;word-break:break-word;
max-width:420px}#heldout-table .cell{max-height:18em;overflow:auto}.two{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
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
    if (typeof v !== 'number' || !scale) { return ''; }  // (null, or "NaN" and the like)
    var a = Math.min(Math.abs(v) / scale, 1);
    var fade = Math.round(255 * (1 - 0.75 * a));
    if (kind === 'entropy') { return 'rgb(255, 255, ' + fade + ')'; }
    return v > 0 ? 'rgb(255, ' + fade + ', ' + fade + ')' :
      v < 0 ? 'rgb(' + fade + ', ' + fade + ', 255)' : '';
  }
  function fmt(x) {
    return (x === null || x === undefined) ? '–' :
      typeof x === 'number' ? x.toFixed(3) : String(x);  // ("NaN", "Infinity": as such)
  }
  function render() {
    var step = data.steps[Number(stepSel.value)], kind = colourSel.value, scale = 0;
    step.groups.forEach(function (g) { g.samples.forEach(function (s) {
      ((s.series || {})[kind] || []).forEach(function (v) {
        if (typeof v === 'number') { scale = Math.max(scale, Math.abs(v)); }
      });
    }); });
    document.getElementById('scale').textContent = scale ?
      'full colour at |' + kind + '| = ' + scale.toFixed(3) : 'no ' + kind + ' in this step';
    var note = document.getElementById('step-note');
    note.textContent = step.note || ''; note.hidden = !step.note;
    var root = document.getElementById('groups');
    root.textContent = '';
    step.groups.forEach(function (g) {
      var box = el('div', 'group'), answer = g.answer === null ? '' : String(g.answer);
      var inline = answer.length <= 80 && answer.indexOf('\n') < 0;  // (else a box of its own)
      box.appendChild(el('div', 'head', 'group ' + g.index +
        (answer && inline ? ' · answer ' + answer : '')));
      box.appendChild(el('pre', 'prompt', g.template || g.prompt));
      if (answer && !inline) { box.appendChild(el('pre', 'prompt', 'answer: ' + answer)); }
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
