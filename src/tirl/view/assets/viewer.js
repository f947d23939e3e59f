// tirl view: a static trajectory viewer. The data is the JSON block above, parsed once; the table is
// virtualised (only the rows in sight exist in the DOM) and a trajectory is rendered when opened, so
// tens of thousands of trajectories open and filter at once. No library, no network.
"use strict";

const STARTED = performance.now();
const DATA = JSON.parse(document.getElementById("tirl-data").textContent);
const TRAJ = DATA.trajectories;
const $ = (sel) => document.querySelector(sel);
const ROW_H = 26;

// ---------- small helpers ----------
const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ESC[c]);
const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : Number.isInteger(x) ? String(x) : Number(x).toFixed(d));
const fixed = (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
const correct = (t) => t.reward > 0.5;
const isTrain = DATA.kind === "train" || TRAJ.some((t) => t.step !== null && t.step !== undefined);

// ---------- Python syntax highlighting (a small tokenizer, enough for tool-call code) ----------
const PY_KW = new Set(("False None True and as assert async await break class continue def del elif else except " +
  "finally for from global if import in is lambda nonlocal not or pass raise return try while with yield match case").split(" "));
const PY_BI = new Set(("abs all any bin bool chr complex dict divmod enumerate filter float format frozenset hex " +
  "input int isinstance len list map max min next oct open ord pow print range repr reversed round set sorted " +
  "str sum tuple type zip").split(" "));
const PY_TOKEN = new RegExp([
  /(#[^\n]*)/.source,                                                                  // 1 comment
  /((?:[rRbBuUfF]{1,2})?(?:"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?))/.source, // 2 string
  /(\b(?:0[xX][\da-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+|\d[\d_]*\.?[\d_]*(?:[eE][+-]?\d+)?j?)|\.\d[\d_]*(?:[eE][+-]?\d+)?j?)/.source, // 3 number
  /(@[A-Za-z_][\w.]*)/.source,                                                          // 4 decorator
  /([A-Za-z_]\w*)/.source,                                                              // 5 name
].join("|"), "g");

function highlightPython(code) {
  let out = "", last = 0, prev = "";
  for (const m of code.matchAll(PY_TOKEN)) {
    out += esc(code.slice(last, m.index));
    const [tok, com, str, num, deco, name] = m;
    let cls = "";
    if (com) cls = "com";
    else if (str) cls = "str";
    else if (num) cls = "numl";
    else if (deco) cls = "deco";
    else if (name) cls = PY_KW.has(name) ? "kw" : prev === "def" || prev === "class" ? "fn" : PY_BI.has(name) ? "bi" : "";
    out += cls ? `<span class="${cls}">${esc(tok)}</span>` : esc(tok);
    if (name) prev = name;
    last = m.index + tok.length;
  }
  return out + esc(code.slice(last));
}

// Model text: the protocol's tags stand out, the <answer> block and \boxed{...} are marked.
const TEXT_TOKEN = /<\/?(?:reason|answer|think)>|<\|[a-z_]+\|>|\\boxed\{/g;

function highlightText(text) {
  let out = "", last = 0, inAnswer = false;
  const plain = (s) => (inAnswer ? `<span class="answer">${esc(s)}</span>` : esc(s));
  for (const m of text.matchAll(TEXT_TOKEN)) {
    out += plain(text.slice(last, m.index));
    const tok = m[0];
    last = m.index + tok.length;
    if (tok === "\\boxed{") {
      let depth = 1, i = last;
      for (; i < text.length && depth; i++) depth += text[i] === "{" ? 1 : text[i] === "}" ? -1 : 0;
      out += `<span class="boxed">${esc(tok + text.slice(last, i))}</span>`;
      last = i;
      continue;
    }
    if (tok === "<answer>") inAnswer = true;
    out += `<span class="${tok.startsWith("<|") ? "special" : "tag"}">${esc(tok)}</span>`;
    if (tok === "</answer>") inAnswer = false;
  }
  return out + plain(text.slice(last));
}

// ---------- table ----------
const COLUMNS = [
  { key: "id", label: "#", width: "48px", num: true, cell: (t) => esc(t.id + 1) },
  { key: "step", label: "step", width: "48px", num: true, train: true, cell: (t) => esc(t.step ?? "") },
  { key: "bench", label: "benchmark", width: "minmax(60px, .8fr)", bench: true, cell: (t) => esc(t.bench) },
  // The problem's text (its id when the record has none), the id and sample in the tooltip.
  { key: "problem", label: "problem", width: "minmax(120px, 2fr)",
    cell: (t) => `<span title="${esc(t.pid)} #${esc(t.sample)}">${esc(t.problem || t.pid)}</span>` },
  { key: "reward", label: "reward", width: "56px", num: true,
    cell: (t) => (correct(t) ? `<span class="good">✓ ${fmt(t.reward, 1)}</span>` : `<span class="bad">✗ ${fmt(t.reward, 1)}</span>`) },
  { key: "answer", label: "answer", width: "minmax(64px, .7fr)", cell: (t) => `<span class="mono">${esc(t.answer ?? "–")}</span>` },
  { key: "reference", label: "ref", width: "minmax(40px, .5fr)", cell: (t) => `<span class="mono">${esc(t.reference ?? "")}</span>` },
  { key: "finish", label: "finish", width: "72px", cell: (t) => esc(t.finish) },
  { key: "nturns", label: "turns", width: "44px", num: true, cell: (t) => esc(t.turns.length) },
  { key: "ncalls", label: "calls", width: "44px", num: true, cell: (t) => esc(t.ncalls) },
  { key: "nerr", label: "errors", width: "52px", num: true, cell: (t) => (t.nerr ? `<span class="bad">${esc(t.nerr)}</span>` : "0") },
  // Turns in which the model wrote a <tool_response> frame itself (made-up tool output).
  { key: "forged", label: "forged", width: "60px", num: true, cell: (t) => (t.forged ? `<span class="bad">${esc(t.forged)}</span>` : "0") },
  { key: "len", label: "tokens", width: "56px", num: true, cell: (t) => esc(t.len) },
  { key: "kept", label: "RoC", width: "62px", train: true,
    cell: (t) => (t.roc ? (t.roc.kept ? '<span class="good">kept</span>' : '<span class="muted">dropped</span>') : "") },
  { key: "adv", label: "adv", width: "52px", num: true, train: true, cell: (t) => (t.roc && t.roc.kept ? fixed(t.roc.advantage, 2) : "") },
];
const SORT_VALUE = {
  nturns: (t) => t.turns.length,
  kept: (t) => (t.roc ? (t.roc.kept ? 1 : 0) : -1),
  adv: (t) => (t.roc && t.roc.kept ? t.roc.advantage : -Infinity),
};
const benches = [...new Set(TRAJ.map((t) => t.bench))];
const columns = COLUMNS.filter((c) => (!c.train || isTrain) && (!c.bench || benches.length > 1 || (benches[0] && !isTrain)));

const state = { shown: TRAJ.slice(), sortKey: "id", sortDesc: false, selected: null, searchCache: {} };

function buildHead() {
  document.documentElement.style.setProperty("--cols", columns.map((c) => c.width).join(" "));
  $("#thead").innerHTML = columns.map((c) => `<div data-key="${c.key}" class="${c.num ? "num" : ""}">${c.label}</div>`).join("");
  $("#thead").addEventListener("click", (e) => {
    const key = e.target.closest("[data-key]")?.dataset.key;
    if (!key) return;
    state.sortDesc = state.sortKey === key ? !state.sortDesc : false;
    state.sortKey = key;
    applyFilters();
  });
}

function renderRows() {
  const scroll = $("#scroll");
  const first = Math.max(0, Math.floor(scroll.scrollTop / ROW_H) - 8);
  const last = Math.min(state.shown.length, first + Math.ceil(scroll.clientHeight / ROW_H) + 16);
  $("#spacer").style.height = state.shown.length * ROW_H + "px";
  const rows = $("#rows");
  rows.style.transform = `translateY(${first * ROW_H}px)`;
  let html = "";
  for (let i = first; i < last; i++) {
    const t = state.shown[i];
    html += `<div class="row${t.id === state.selected ? " selected" : ""}" data-id="${esc(t.id)}">` +
      columns.map((c) => `<div class="${c.num ? "num" : ""}">${c.cell(t)}</div>`).join("") + "</div>";
  }
  rows.innerHTML = html;
}

let frame = 0;
const scheduleRows = () => { if (!frame) frame = requestAnimationFrame(() => { frame = 0; renderRows(); }); };

// ---------- filters ----------
function fillSelect(sel, first, values) {
  sel.innerHTML = `<option value="">${first}</option>` + values.map((v) => `<option value="${esc(v)}">${esc(v)}</option>`).join("");
}

const steps = [...new Set(TRAJ.map((t) => t.step).filter((s) => s !== null && s !== undefined))].sort((a, b) => a - b);

function haystack(t, scope) {
  // Built on the first search of each scope and kept: later keystrokes only scan strings.
  const cache = (state.searchCache[scope] ||= new Array(TRAJ.length));
  if (cache[t.id] === undefined) {
    const parts = [];
    if (scope !== "code") parts.push(t.problem, t.pid, t.answer ?? "");
    for (const turn of t.turns) {
      for (const [kind, p] of turn.parts) {
        if (kind === "text" && scope !== "code") parts.push(p);
        if (kind === "call") {
          if (scope !== "text") parts.push(p.code, p.input ?? "");
          if (scope === "all") parts.push(p.response ?? "", p.parse_error ?? "");
        }
      }
    }
    cache[t.id] = parts.join("\n").toLowerCase();
  }
  return cache[t.id];
}

function currentStep() {
  return $("#f-allsteps").checked || !steps.length ? null : steps[Number($("#f-step").value)];
}

function applyFilters() {
  const q = $("#q").value.trim().toLowerCase();
  const scope = $("#scope").value;
  const bench = $("#f-bench").value, corr = $("#f-correct").value, finish = $("#f-finish").value;
  const tools = $("#f-tools").value, kept = $("#f-kept").value;
  const minLen = $("#f-minlen").value === "" ? -Infinity : Number($("#f-minlen").value);
  const maxLen = $("#f-maxlen").value === "" ? Infinity : Number($("#f-maxlen").value);
  const step = currentStep();
  const toolOk = {
    "": () => true,
    none: (t) => t.ncalls === 0,
    clean: (t) => t.ncalls > 0 && t.nerr === 0,
    errors: (t) => t.nerr > 0,
  }[tools] || ((t) => (t.statuses[tools] || 0) > 0);
  const shown = TRAJ.filter((t) =>
    (!bench || t.bench === bench) &&
    (!corr || correct(t) === (corr === "1")) &&
    (!finish || t.finish === finish) &&
    toolOk(t) &&
    t.len >= minLen && t.len <= maxLen &&
    (!kept || (t.roc && t.roc.kept === (kept === "1"))) &&
    (step === null || t.step === step) &&
    (!q || haystack(t, scope).includes(q)));
  const key = state.sortKey, get = SORT_VALUE[key] || ((t) => t[key]), dir = state.sortDesc ? -1 : 1;
  shown.sort((a, b) => {
    const x = get(a) ?? "", y = get(b) ?? "";
    return (x < y ? -1 : x > y ? 1 : a.id - b.id) * dir;
  });
  state.shown = shown;
  // The detail pane shows a trajectory the filters keep: the first shown one, or none.
  if (state.selected !== null && !shown.includes(TRAJ[state.selected])) {
    if (shown.length) select(shown[0].id, false);
    else clearDetail();
  }
  for (const el of document.querySelectorAll("#thead > div")) {
    el.classList.toggle("sorted", el.dataset.key === key);
    el.classList.toggle("desc", el.dataset.key === key && state.sortDesc);
  }
  const count = $("#count");
  count.textContent = `${shown.length} of ${TRAJ.length} trajectories`;
  count.dataset.shown = String(shown.length);
  $("#step-label").textContent = step === null ? "" : `step ${step}`;
  markCurrentStep(step);
  renderRows();
}

function resetFilters() {
  for (const id of ["#q", "#f-bench", "#f-correct", "#f-finish", "#f-tools", "#f-minlen", "#f-maxlen", "#f-kept"]) $(id).value = "";
  $("#scope").value = "all";
  $("#f-step").value = "0";
  $("#f-allsteps").checked = true;
  applyFilters();
}

function showStep(step) {
  const i = steps.indexOf(step);
  if (i < 0) return;
  $("#f-step").value = String(i);
  $("#f-allsteps").checked = false;
  applyFilters();
}

// ---------- one trajectory ----------
function clearDetail() {
  state.selected = null;
  $("#detail").innerHTML = `<p class="hint">no trajectory matches the filters</p>`;
  if (location.hash) history.replaceState(null, "", location.pathname + location.search);
}

function select(id, scrollIntoView) {
  state.selected = id;
  const t = TRAJ[id];
  $("#detail").innerHTML = renderTrajectory(t);
  $("#detail").scrollTop = 0;
  if (location.hash !== `#t=${id}`) history.replaceState(null, "", `#t=${id}`);
  if (scrollIntoView) {
    const i = state.shown.indexOf(t), scroll = $("#scroll");
    if (i >= 0 && (i * ROW_H < scroll.scrollTop || (i + 1) * ROW_H > scroll.scrollTop + scroll.clientHeight)) {
      scroll.scrollTop = i * ROW_H - scroll.clientHeight / 2;
    }
  }
  renderRows();
}

function renderTrajectory(t) {
  const where = [t.bench, t.step !== null && t.step !== undefined ? `step ${t.step}` : ""].filter(Boolean).join(" · ");
  const ok = correct(t);
  let html = `<h2>${esc(t.pid)} <span class="muted">sample ${esc(t.sample)}${where ? " · " + esc(where) : ""}</span></h2>`;
  html += `<div class="badges">
    <span class="badge ${ok ? "correct" : "wrong"}" id="reward">reward ${Number(t.reward).toFixed(1)} · ${ok ? "correct" : "wrong"}</span>
    <span class="badge">answer <b class="mono">${esc(t.answer ?? "none")}</b></span>
    <span class="badge">reference <b class="mono">${esc(t.reference ?? "–")}</b></span>
    <span class="badge ${t.finish === "error" ? "error" : ""}">finish: ${esc(t.finish)}</span>
    ${t.forged ? `<span class="badge error" id="forged">${esc(t.forged)} forged tool response${t.forged > 1 ? "s" : ""}</span>` : ""}
    <span class="badge">${esc(t.turns.length)} turns · ${esc(t.ncalls)} tool calls · ${esc(t.nerr)} errored</span>
    <span class="badge">${esc(t.prompt_len ?? "?")} prompt + ${esc(t.gen)} generated + ${esc(t.len - t.gen)} tool tokens</span>
    <span class="badge">${fmt(t.gen_s, 1)} s generating · ${fmt(t.tool_s, 1)} s waiting for tools</span>
  </div>`;
  if (t.error) html += `<div class="box"><h4>error</h4><pre class="response st-runtime_error">${esc(t.error)}</pre></div>`;
  if (t.note) html += `<div class="box" id="note"><h4>note</h4><div class="text">${esc(t.note)}</div></div>`;
  html += `<div class="box" id="roc"><h4>Resample-on-Correct</h4><div class="kv">
    <div><span>p_err</span>${fixed(t.p_err)}</div><div><span>p_format</span>${fixed(t.p_format)}</div>
    <div><span>p_total</span>${fixed(t.p_total)}</div>`;
  if (t.roc) {
    html += `<div><span>RoC</span><b class="${t.roc.kept ? "good" : "bad"}">${t.roc.kept ? "kept" : "dropped"}</b></div>
      <div><span>advantage</span>${t.roc.kept ? fixed(t.roc.advantage) : "– (not trained)"}</div>
      <div><span>group</span>${esc(t.roc.group_correct)}/${esc(t.roc.group_size)} correct, ${esc(t.roc.group_kept)} kept</div>`;
  }
  html += `</div></div>`;
  html += `<div class="box"><h4>problem</h4><div class="text">${esc(t.problem || "(problem text not recorded)")}</div></div>`;
  t.turns.forEach((turn, k) => {
    const tokens = turn.gen === null || turn.gen === undefined ? "" :
      ` · ${esc(turn.gen)} generated tokens` + (turn.tool ? ` · ${esc(turn.tool)} tool-response tokens` : "");
    html += `<section class="turn"><div class="turn-head">turn ${k + 1}${tokens}</div>`;
    for (const [kind, p] of turn.parts) html += kind === "text" ? `<div class="text">${highlightText(p)}</div>` : renderCall(p);
    html += `</section>`;
  });
  return html;
}

const STATUS_LABEL = { ok: "ok", runtime_error: "error", other_error: "error", timeout: "timeout", malformed: "malformed",
  sandbox_error: "sandbox failure", not_run: "not run" };

function renderCall(c) {
  let html = `<div class="call"><div class="call-head"><span class="status st-${esc(c.status)}">${esc(STATUS_LABEL[c.status] || c.status)}</span>` +
    `<span class="muted">python tool call</span>${c.wall_ms ? `<span class="muted">${fmt(c.wall_ms, 0)} ms</span>` : ""}</div>`;
  if (c.parse_error) html += `<div class="parse-error">${esc(c.parse_error)}</div>`;
  // A malformed call is raw text (often one long JSON line): wrapped, so none of it is out of view.
  html += c.parse_error ? `<pre class="code raw">${esc(c.code)}</pre>` : `<pre class="code">${highlightPython(c.code)}</pre>`;
  if (c.input) html += `<pre class="stdin">stdin: ${esc(c.input)}</pre>`;
  if (c.response !== null && c.response !== undefined) html += `<pre class="response st-${esc(c.status)}">${esc(c.response)}</pre>`;
  return html + `</div>`;
}

// ---------- header, summary and curves ----------
function renderSummary() {
  $("#source").textContent = DATA.source;
  const cards = [];
  for (const [name, m] of Object.entries(DATA.summary || {})) {
    cards.push(`<span class="card">${esc(name)}: <b>${pct(m.pass1)}</b> avg@${esc(m.samples)} pass@1 · maj ${pct(m.maj)} · ` +
      `tool errors ${pct(m.tool_error_rate)} · ${fmt(m.mean_response_tokens, 0)} tokens</span>`);
  }
  if (DATA.curves.length) {
    const last = DATA.curves[DATA.curves.length - 1];
    cards.push(`<span class="card"><b>${DATA.curves.length}</b> steps · last reward <b>${fmt(last.reward, 3)}</b> · ` +
      `<b>${TRAJ.length}</b> sampled trajectories</span>`);
  }
  $("#summary").innerHTML = cards.join("");
}

const CURVES = [
  ["reward", "reward (mean)"],
  ["err_correct", "tool-error ratio in correct trajectories"],
  ["length", "response length (tokens)"],
];

function renderCurves() {
  const rows = DATA.curves;
  if (!rows.length) return;
  const box = $("#curves");
  box.hidden = false;
  const sampled = new Set(steps);
  const W = 320, H = 110, L = 34, R = 6, T = 6, B = 16;
  box.innerHTML = CURVES.map(([key, title]) => {
    const pts = rows.filter((r) => typeof r[key] === "number");
    const empty = rows.some((r) => key in r) ? "empty at every step so far" : "not logged";
    if (!pts.length) return `<div class="chart"><h3>${title}</h3><p class="hint">${empty}</p></div>`;
    const xs = pts.map((r) => r.step), ys = pts.map((r) => r[key]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys) || 1;
    const X = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const Y = (y) => T + (1 - (y - y0) / (y1 - y0 || 1)) * (H - T - B);
    const line = pts.map((r) => `${X(r.step).toFixed(1)},${Y(r[key]).toFixed(1)}`).join(" ");
    const dots = pts.map((r) => {
      const title = `step ${r.step}: ${fmt(r[key], 4)}${sampled.has(r.step) ? " (click: its trajectories)" : ""}`;
      return `<g data-step="${esc(r.step)}"><title>${esc(title)}</title>` +
        `<circle class="hit" cx="${X(r.step)}" cy="${Y(r[key])}" r="8"></circle>` +
        `<circle class="pt${sampled.has(r.step) ? " sampled" : ""}" data-step="${esc(r.step)}" cx="${X(r.step)}" cy="${Y(r[key])}" r="3"></circle></g>`;
    }).join("");
    return `<div class="chart" data-key="${key}"><h3>${title}</h3>
      <svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">
        <line class="axis" x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"></line>
        <line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"></line>
        <text class="tick" x="${L - 3}" y="${T + 8}" text-anchor="end">${fmt(y1, 2)}</text>
        <text class="tick" x="${L - 3}" y="${H - B}" text-anchor="end">${fmt(y0, 2)}</text>
        <text class="tick" x="${L}" y="${H - 4}">${esc(x0)}</text>
        <text class="tick" x="${W - R}" y="${H - 4}" text-anchor="end">step ${esc(x1)}</text>
        <line class="cursor" x1="-10" x2="-10" y1="${T}" y2="${H - B}"></line>
        <polyline points="${line}"></polyline>${dots}
      </svg></div>`;
  }).join("");
  box.addEventListener("click", (e) => {
    const g = e.target.closest("[data-step]");
    if (g) showStep(Number(g.dataset.step));
  });
}

function markCurrentStep(step) {
  for (const chart of document.querySelectorAll("#curves .chart")) {
    const svg = chart.querySelector("svg");
    if (!svg) continue;
    let x = -10;
    for (const c of svg.querySelectorAll("circle.pt")) {
      const here = step !== null && Number(c.dataset.step) === step;
      c.classList.toggle("current", here);
      if (here) x = c.getAttribute("cx");
    }
    const cursor = svg.querySelector("line.cursor");
    cursor.setAttribute("x1", x);
    cursor.setAttribute("x2", x);
  }
}

// ---------- wiring ----------
function init() {
  document.title = `tirl view: ${DATA.source}`;
  renderSummary();
  buildHead();
  fillSelect($("#f-bench"), "all benchmarks", benches.filter(Boolean));
  $("#f-bench").hidden = benches.length < 2;
  fillSelect($("#f-finish"), "any finish", [...new Set(TRAJ.map((t) => t.finish))].sort());
  if (isTrain) {
    $("#f-kept").hidden = false;
    if (steps.length) {
      $("#step-box").hidden = false;
      $("#f-step").max = String(steps.length - 1);
    }
  }
  renderCurves();
  let typing = 0;
  $("#q").addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(applyFilters, 120); });
  for (const id of ["#scope", "#f-bench", "#f-correct", "#f-finish", "#f-tools", "#f-kept", "#f-allsteps"]) {
    $(id).addEventListener("change", applyFilters);
  }
  for (const id of ["#f-minlen", "#f-maxlen"]) $(id).addEventListener("input", applyFilters);
  $("#f-step").addEventListener("input", () => { $("#f-allsteps").checked = false; applyFilters(); });
  $("#reset").addEventListener("click", resetFilters);
  $("#scroll").addEventListener("scroll", scheduleRows);
  window.addEventListener("resize", scheduleRows);
  $("#rows").addEventListener("click", (e) => {
    const row = e.target.closest(".row");
    if (row) select(Number(row.dataset.id), false);
  });
  document.addEventListener("keydown", (e) => {
    if (e.target.matches("input, select") || !["j", "k"].includes(e.key) || !state.shown.length) return;
    const i = state.shown.findIndex((t) => t.id === state.selected);
    const next = e.key === "j" ? Math.min(i + 1, state.shown.length - 1) : Math.max(i - 1, 0);
    select(state.shown[next].id, true);
  });
  applyFilters();
  const m = /^#t=(\d+)$/.exec(location.hash);
  if (m && TRAJ[Number(m[1])]) select(Number(m[1]), true);
  document.body.dataset.initMs = (performance.now() - STARTED).toFixed(1);  // parse + first render
  document.body.dataset.ready = "1";
}

init();
