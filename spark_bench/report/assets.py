"""The report page's stylesheet and script (vanilla JS, no libraries besides the embedded plotly.js).

The script reads everything from one `<script type="application/json" id="sb-data">` block and only ever writes text
with `textContent`, so nothing from the results can become markup. It exposes `window.sparkBench` (rendered figure
count, errors) for the browser test.
"""

from collections.abc import Sequence

# Fixed colours for the backends we know, so a backend looks the same in every report; others take the rest in order.
KNOWN_COLOURS = {"triton": "#1f77b4", "torch": "#ff7f0e", "torch_compile": "#2ca02c", "reference": "#7f7f7f",
                 "fla": "#9467bd", "vllm": "#d62728", "gguf": "#8c564b"}
SPARE_COLOURS = ["#e377c2", "#17becf", "#bcbd22", "#393b79", "#ad494a", "#637939", "#7b4173", "#3182bd", "#e6550d"]


def palette(backends: Sequence[str]) -> dict[str, str]:
    """Backend -> colour: known names fixed, the others in sorted order from the spare list (cycling)."""
    out, spare = {}, 0
    for b in sorted(set(backends)):
        if b in KNOWN_COLOURS:
            out[b] = KNOWN_COLOURS[b]
        else:
            out[b] = SPARE_COLOURS[spare % len(SPARE_COLOURS)]
            spare += 1
    return out


CSS = """
:root { --fg: #1d2330; --muted: #5b6475; --line: #dde1e8; --bg: #f6f7f9; --ok: #1a7f37; --bad: #cf222e;
        --warn: #9a6700; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
       background: var(--bg); }
header.top { position: sticky; top: 0; z-index: 10; background: #1d2330; color: #fff; padding: 8px 20px;
             display: flex; gap: 18px; align-items: baseline; flex-wrap: wrap; }
header.top b { font-size: 16px; }
header.top a { color: #c9d4ff; text-decoration: none; font-size: 13px; }
main { padding: 12px 20px 40px; max-width: 1700px; margin: 0 auto; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 12px 16px; margin: 14px 0; }
h2 { font-size: 18px; margin: 2px 0 8px; }
h3 { font-size: 15px; margin: 12px 0 6px; }
.muted { color: var(--muted); }
table.static, table.sb { border-collapse: collapse; font-size: 13px; }
table.static th, table.static td, table.sb th, table.sb td { border-bottom: 1px solid var(--line); padding: 4px 8px;
  text-align: left; vertical-align: top; }
table.static th, table.sb th { background: #f0f2f5; font-weight: 600; white-space: nowrap; }
table.env th { text-align: right; color: var(--muted); font-weight: 500; background: none; }
.envgrid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 2px 24px;
           font-size: 13px; }
.envgrid > div { display: flex; gap: 10px; border-bottom: 1px solid var(--line); padding: 3px 0; }
.envgrid b { flex: 0 0 110px; color: var(--muted); font-weight: 500; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.code { white-space: nowrap; }
td.code, span.code { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
td.err { max-width: 720px; white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace;
         font-size: 12px; }
.st-ok, .v-faster, .v-fixed { color: var(--ok); font-weight: 600; }
.st-mismatch, .st-error, .st-crash, .st-timeout, .st-oom, .v-slower, .v-broken, .v-failing { color: var(--bad);
  font-weight: 600; }
.st-skipped, .v-same { color: var(--muted); }
.v-noisy { color: var(--warn); font-weight: 600; }
.pill { display: inline-block; padding: 1px 8px; border-radius: 10px; background: #eef1f5; margin-right: 6px;
        font-size: 12px; }
.pill.bad { background: #ffebe9; color: var(--bad); }
.pill.good { background: #dafbe1; color: var(--ok); }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 5px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 10px; }
.grid > div { border: 1px solid var(--line); border-radius: 4px; min-height: 330px; }
.controls { display: flex; gap: 14px; align-items: center; flex-wrap: wrap; margin: 4px 0 8px; }
details > summary { cursor: pointer; color: #0b57d0; margin: 6px 0; }
.sb-tools { display: flex; gap: 10px; align-items: center; margin: 6px 0; flex-wrap: wrap; }
.sb-tools input { width: 420px; padding: 4px 8px; border: 1px solid var(--line); border-radius: 4px; }
.sb-tools button, .sb-more { padding: 3px 10px; border: 1px solid #b8c0cc; border-radius: 4px; background: #fff;
  cursor: pointer; }
table.sb th { cursor: pointer; user-select: none; }
table.sb th.asc::after { content: " \\25B2"; } table.sb th.desc::after { content: " \\25BC"; }
.tablewrap { max-height: 620px; overflow: auto; border: 1px solid var(--line); }
.tablewrap table { width: 100%; }
table.sb td { white-space: nowrap; }
table.sb td.err { white-space: pre-wrap; min-width: 360px; }
.tablewrap th { position: sticky; top: 0; }
"""

JS = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("sb-data").textContent);
  var SB = window.sparkBench = {rendered: 0, expected: D.figs.length, done: false, errors: []};
  var CONFIG = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"]};

  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  // --- figures ------------------------------------------------------------------------------------------------
  // Charts in the viewport are drawn synchronously, before the load event (a headless screenshot taken at load
  // shows them, no wait needed); the rest follow one per task, whichever is in view first, so scrolling to a chart
  // draws it next and the page stays responsive.
  function inView(f) {
    var r = document.getElementById(f.id).getBoundingClientRect();
    return r.bottom > 0 && r.top < (window.innerHeight || document.documentElement.clientHeight);
  }
  function draw(f) {
    f.fig.data.forEach(function (t) {  // hover texts are stored once per case, shared by every chart
      if (t.meta && t.meta.h) t.hovertext = t.meta.h.map(function (k) { return D.hover[k]; });
    });
    var settle = function () { if (SB.rendered + SB.errors.length >= SB.expected) SB.done = true; };
    try {
      Plotly.newPlot(document.getElementById(f.id), f.fig.data, f.fig.layout, CONFIG)
        .then(function () { SB.rendered++; settle(); })
        .catch(function (e) { SB.errors.push(String(e)); settle(); });
    } catch (e) { SB.errors.push(String(e)); settle(); }
  }
  function renderFigures() {
    var pending = D.figs.slice();
    SB.inViewAtStart = 0;
    pending = pending.filter(function (f) {
      if (!inView(f)) return true;
      SB.inViewAtStart++; draw(f); return false;
    });
    if (!D.figs.length) SB.done = true;
    function next() {
      if (!pending.length) return;
      var k = pending.findIndex(inView);
      draw(pending.splice(k < 0 ? 0 : k, 1)[0]);
      setTimeout(next, 0);
    }
    setTimeout(next, 0);
  }

  function selectedCombo(op) {
    var sel = document.querySelector('select.sb-combo[data-op="' + op + '"]');
    return sel ? Number(sel.value) : 0;
  }

  function showCombo(op) {
    var c = selectedCombo(op);
    document.querySelectorAll('[data-op-figs="' + op + '"] .js-plotly-plot').forEach(function (gd) {
      var vis = gd.data.map(function (t) { return t.meta && t.meta.combo !== undefined ? t.meta.combo === c : true; });
      Plotly.restyle(gd, {visible: vis});
    });
    var det = document.querySelector('details.sb-box[data-op="' + op + '"]');
    if (det && det.open) drawBoxes(det);
  }

  function drawBoxes(det) {
    var op = det.dataset.op, c = selectedCombo(op), sets = D.samples[op] || [], byName = {}, order = [];
    sets.forEach(function (s) {
      if (s.c !== c) return;
      if (!byName[s.n]) { byName[s.n] = {x: [], y: [], b: s.b, run: s.run}; order.push(s.n); }
      s.s.forEach(function (v) { byName[s.n].x.push(s.x); byName[s.n].y.push(v); });
    });
    var traces = order.map(function (n) {
      var t = byName[n];
      return {type: "box", name: n, x: t.x, y: t.y, marker: {color: D.colours[t.b] || "#333", size: 3},
              boxpoints: "outliers", line: {width: 1.2}};
    });
    var layout = JSON.parse(JSON.stringify(D.boxLayout[op]));
    Plotly.react(det.querySelector(".sb-boxplot"), traces, layout, CONFIG);
  }

  // --- tables ---------------------------------------------------------------------------------------------------
  function cmp(a, b) {
    if (a === null || a === undefined || a === "") return (b === null || b === undefined || b === "") ? 0 : 1;
    if (b === null || b === undefined || b === "") return -1;
    if (typeof a === "number" && typeof b === "number") return a - b;
    return String(a).localeCompare(String(b), undefined, {numeric: true});
  }

  function matcher(query, cols) {
    var terms = query.trim().toLowerCase().split(/\s+/).filter(Boolean).map(function (t) {
      var neg = t[0] === "-" && t.length > 1;
      if (neg) t = t.slice(1);
      var m = /^([a-z0-9_%]+)(:|>=|<=|>|<|=)(.+)$/.exec(t);
      if (m) {
        var idx = cols.findIndex(function (c) { return c.name.toLowerCase().indexOf(m[1]) === 0; });
        if (idx >= 0) return {col: idx, op: m[2], v: m[3], neg: neg};
      }
      return {col: -1, op: ":", v: t, neg: neg};
    });
    return function (row) {
      return terms.every(function (t) {
        var hit;
        if (t.col < 0) hit = row.some(function (x) { return x !== null && String(x).toLowerCase().indexOf(t.v) >= 0; });
        else {
          var x = row[t.col], n = Number(t.v);
          if (t.op === ":") hit = x !== null && String(x).toLowerCase().indexOf(t.v) >= 0;
          else if (t.op === "=") hit = x !== null && String(x).toLowerCase() === t.v;
          else if (x === null || typeof x !== "number" || isNaN(n)) hit = false;
          else hit = t.op === ">" ? x > n : t.op === "<" ? x < n : t.op === ">=" ? x >= n : x <= n;
        }
        return t.neg ? !hit : hit;
      });
    };
  }

  function fmt(v, col) {
    if (v === null || v === undefined) return "";
    if (typeof v === "number") {
      if (col.digits !== undefined) return v.toFixed(col.digits);
      return String(+v.toPrecision(col.sig || 4));  // significant digits: a small real value never reads 0.0
    }
    return String(v);
  }

  function csvCell(v) {
    if (v === null || v === undefined) return "";
    if (typeof v === "number") return String(v);
    var s = String(v);
    if (/^[=+@\t\r-]/.test(s)) s = "'" + s;  // never a formula in a spreadsheet
    return /[",\n\r]/.test(s) ? '"' + s.replace(/"/g, '""') + '"' : s;
  }

  function makeTable(host) {
    var spec = D.tables[host.dataset.table], cols = spec.columns, LIMIT = 400;
    var state = {sort: -1, dir: 1, query: "", limit: LIMIT};
    var tools = el("div", null, "sb-tools"), input = el("input"), count = el("span", null, "muted");
    var csv = el("button", "Export CSV"), more = el("button", "Show all", "sb-more");
    input.type = "search";
    input.placeholder = "filter: words, or column:text, column>number, -word (e.g. status:mismatch backend:triton)";
    tools.append(input, csv, count, more);
    var wrap = el("div", null, "tablewrap"), table = el("table", null, "sb"), thead = el("thead"), tbody = el("tbody");
    var hr = el("tr");
    cols.forEach(function (c, i) {
      var th = el("th", c.name);
      if (c.title) th.title = c.title;
      th.addEventListener("click", function () {
        state.dir = state.sort === i ? -state.dir : 1; state.sort = i; draw();
      });
      hr.appendChild(th);
    });
    thead.appendChild(hr); table.append(thead, tbody); wrap.appendChild(table); host.append(tools, wrap);

    function rows() {
      var out = spec.rows.filter(matcher(state.query, cols));
      if (state.sort >= 0) {
        var i = state.sort;
        out.sort(function (a, b) {
          var na = a[i] === null || a[i] === "", nb = b[i] === null || b[i] === "";
          if (na || nb) return na - nb;  // blanks last either way
          return state.dir * cmp(a[i], b[i]);
        });
      }
      return out;
    }

    function draw() {
      var all = rows(), shown = all.slice(0, state.limit);
      tbody.textContent = "";
      var frag = document.createDocumentFragment();
      shown.forEach(function (row) {
        var tr = el("tr");
        row.forEach(function (v, i) {
          var c = cols[i], td = el("td", fmt(v, c), c.cls || (typeof v === "number" ? "num" : ""));
          if (c.tag && v) td.classList.add(c.tag + "-" + String(v).replace(/[^a-z]/gi, ""));
          tr.appendChild(td);
        });
        frag.appendChild(tr);
      });
      tbody.appendChild(frag);
      hr.childNodes.forEach(function (th, i) {
        th.classList.toggle("asc", i === state.sort && state.dir > 0);
        th.classList.toggle("desc", i === state.sort && state.dir < 0);
      });
      count.textContent = all.length + " of " + spec.rows.length + " rows" +
        (all.length > shown.length ? " (first " + shown.length + " shown)" : "");
      more.style.display = all.length > shown.length ? "" : "none";
    }

    input.addEventListener("input", function () { state.query = input.value; state.limit = LIMIT; draw(); });
    more.addEventListener("click", function () { state.limit = Infinity; draw(); });
    csv.addEventListener("click", function () {
      var lines = [cols.map(function (c) { return csvCell(c.name); }).join(",")];
      rows().forEach(function (r) { lines.push(r.map(csvCell).join(",")); });
      var a = el("a");
      a.href = URL.createObjectURL(new Blob([lines.join("\r\n") + "\r\n"], {type: "text/csv"}));
      a.download = host.dataset.table + ".csv";
      document.body.appendChild(a); a.click(); a.remove();
    });
    draw();
  }

  document.querySelectorAll("select.sb-combo").forEach(function (sel) {
    sel.addEventListener("change", function () { showCombo(sel.dataset.op); });
  });
  document.querySelectorAll("details.sb-box").forEach(function (det) {
    det.addEventListener("toggle", function () { if (det.open) drawBoxes(det); });
  });
  document.querySelectorAll("[data-table]").forEach(makeTable);
  renderFigures();
})();
"""
