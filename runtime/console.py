"""The web console of ``layerzero serve``: ``GET /`` of the control port.

One self-contained page (no external asset: its script and style are inline and pinned by hash in its
Content-Security-Policy, which also forbids every other origin). Every two seconds it reads ``GET /metrics`` —
the same counters Prometheus scrapes — and shows the requests and fallbacks per segment, the window fallback
rate, the zeroing threshold, the kill switch, the zeroed-parameter ratio and each dynamic path's skip rate
(``skips_total{path}`` / requests). Its controls call the control endpoints that exist for scripts: the kill-switch
button ``POST /kill-switch {"on": ...}`` ("one click switches back to standard mode"), the threshold form
``POST /threshold {"value", "segment"}``; an endpoint's refusal is shown as its one-line error.

Everything the page shows is set as text (``textContent``), never parsed as HTML: a path or segment name from
the model cannot inject markup.
"""

from __future__ import annotations

import base64
import hashlib

__all__ = ["CONSOLE_CSP", "CONSOLE_HTML", "console_page"]

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 60em; }
h1 { font-size: 1.3em; margin: 0 0 .2em; }
.muted { color: #666; }
table { border-collapse: collapse; margin: .6em 0 1.2em; }
th, td { text-align: left; padding: .2em .9em .2em 0; border-bottom: 1px solid #eee; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.tiles { display: flex; gap: 1em; flex-wrap: wrap; margin: .8em 0; }
.tile { border: 1px solid #ddd; border-radius: 6px; padding: .5em .9em; min-width: 9em; }
.tile b { display: block; font-size: 1.4em; }
button { font: inherit; padding: .3em .9em; }
#kill.on { background: #c62828; color: #fff; }
#error { color: #c62828; min-height: 1.2em; }
"""

_SCRIPT = r"""
"use strict";
const $ = (id) => document.getElementById(id);
let killOn = false;

// Prometheus text exposition -> [{name, labels, value}] (label values unescaped: \\ \" \n).
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    let i = 0;
    while (i < line.length && line[i] !== "{" && line[i] !== " ") i++;
    const name = line.slice(0, i);
    const labels = {};
    if (line[i] === "{") {
      i++;
      while (i < line.length && line[i] !== "}") {
        const eq = line.indexOf("=", i);
        const key = line.slice(i, eq).replace(/^[\s,]+/, "");
        i = eq + 2;  // past ="
        let value = "";
        while (i < line.length && line[i] !== '"') {
          if (line[i] === "\\" && i + 1 < line.length) {
            const c = line[i + 1];
            value += c === "n" ? "\n" : c;
            i += 2;
          } else {
            value += line[i++];
          }
        }
        labels[key] = value;
        i++;  // the closing quote
        while (i < line.length && (line[i] === "," || line[i] === " ")) i++;
      }
      i++;  // the closing brace
    }
    const value = parseFloat(line.slice(i).trim().split(" ")[0]);
    samples.push({ name, labels, value });
  }
  return samples;
}

function pick(samples, name) { return samples.filter((s) => s.name === name); }
function fmt(x, digits) { return Number.isFinite(x) ? x.toFixed(digits) : "-"; }
function pct(x) { return Number.isFinite(x) ? (100 * x).toFixed(1) + "%" : "-"; }

function fillTable(id, rows) {
  const body = $(id);
  body.replaceChildren();
  for (const row of rows) {
    const tr = document.createElement("tr");
    row.forEach((cell, k) => {
      const td = document.createElement("td");
      td.textContent = cell;
      if (k > 0) td.className = "n";
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
}

async function refresh() {
  let text;
  try {
    const r = await fetch("/metrics", { cache: "no-store" });
    text = await r.text();
  } catch (e) {
    $("state").textContent = "control server unreachable";
    return;
  }
  const m = parseMetrics(text);
  const requests = pick(m, "layerzero_requests_total");
  const fallbacks = pick(m, "layerzero_fallbacks_total");
  const rate = pick(m, "layerzero_window_fallback_rate");
  const thr = pick(m, "layerzero_zeroing_threshold");
  const total = requests.reduce((a, s) => a + s.value, 0);
  const totalFallbacks = fallbacks.reduce((a, s) => a + s.value, 0);
  const ratio = pick(m, "layerzero_zeroed_params_ratio")[0];
  const kill = pick(m, "layerzero_kill_switch")[0];
  killOn = !!(kill && kill.value);
  $("requests").textContent = String(total);
  $("fallbacks").textContent = String(totalFallbacks);
  $("fallback-rate").textContent = pct(total ? totalFallbacks / total : NaN);
  $("zeroed").textContent = ratio ? pct(ratio.value) : "-";
  $("kill-state").textContent = killOn ? "on (every request runs the reference)" : "off";
  $("kill").textContent = killOn ? "Turn the kill switch off" : "Turn the kill switch on";
  $("kill").className = killOn ? "on" : "";
  const segments = requests.map((s) => s.labels.segment);
  fillTable("segments", segments.map((seg) => {
    const get = (list) => { const s = list.find((x) => x.labels.segment === seg); return s ? s.value : NaN; };
    return [seg, String(get(requests)), String(get(fallbacks)), pct(get(rate)), fmt(get(thr), 4)];
  }));
  const select = $("segment");
  const chosen = select.value;
  select.replaceChildren();
  for (const seg of segments) {
    const o = document.createElement("option");
    o.value = seg;
    o.textContent = seg;
    select.appendChild(o);
  }
  if (segments.includes(chosen)) select.value = chosen;
  const skips = pick(m, "layerzero_skips_total").sort((a, b) => b.value - a.value);
  fillTable("paths", skips.map((s) => [s.labels.path, String(s.value), pct(total ? s.value / total : NaN)]));
  $("state").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.loaded = "1";
}

async function post(path, body) {
  const r = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                body: JSON.stringify(body) });
  const answer = await r.json().catch(() => ({}));
  $("error").textContent = r.ok ? "" : (answer.error || ("HTTP " + r.status));
  await refresh();
}

$("kill").addEventListener("click", () => post("/kill-switch", { on: !killOn }));
$("threshold-form").addEventListener("submit", (e) => {
  e.preventDefault();
  post("/threshold", { value: parseFloat($("threshold").value), segment: $("segment").value });
});
refresh();
setInterval(refresh, 2000);
"""

_BODY = """<h1>LayerZero</h1>
<div class="muted" id="state">loading</div>
<div class="tiles">
  <div class="tile">requests<b id="requests">-</b></div>
  <div class="tile">fallbacks<b id="fallbacks">-</b></div>
  <div class="tile">fallback rate<b id="fallback-rate">-</b></div>
  <div class="tile">parameters zeroed (compile)<b id="zeroed">-</b></div>
</div>
<p>Kill switch: <span id="kill-state">-</span> <button id="kill" type="button">Turn the kill switch on</button></p>
<form id="threshold-form">Zeroing threshold <input id="threshold" type="number" min="0" max="1" step="any"
  required> for segment <select id="segment"></select> <button type="submit">Set</button></form>
<div id="error"></div>
<h2>Segments</h2>
<table><thead><tr><th>segment</th><th>requests</th><th>fallbacks</th><th>window fallback rate</th>
<th>threshold</th></tr></thead><tbody id="segments"></tbody></table>
<h2>Dynamic paths</h2>
<table><thead><tr><th>path</th><th>requests skipping it</th><th>skip rate</th></tr></thead>
<tbody id="paths"></tbody></table>
"""


def _hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


#: The page's Content-Security-Policy: its own inline script and style (by hash), fetches to its own origin only.
CONSOLE_CSP = (
    f"default-src 'none'; script-src {_hash(_SCRIPT)}; style-src {_hash(_STYLE)}; connect-src 'self'; "
    "img-src 'none'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)

CONSOLE_HTML = (
    '<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>LayerZero console</title>'
    f"<style>{_STYLE}</style></head>\n<body>\n{_BODY}<script>{_SCRIPT}</script>\n</body></html>\n"
).encode()


def console_page() -> tuple[bytes, dict[str, str]]:
    """The page and the headers to send with it."""
    return CONSOLE_HTML, {
        "Content-Type": "text/html; charset=utf-8",
        "Content-Security-Policy": CONSOLE_CSP,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-store",
    }
