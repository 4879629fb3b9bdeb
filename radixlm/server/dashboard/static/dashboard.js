// radixlm /dashboard: reads /dashboard/stream (SSE over fetch, so that the API key travels in
// the Authorization header, never in the URL) and draws plain SVG. No library, no network
// beyond this server.
"use strict";

const KEY_STORE = "radixlm-dashboard-key";
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

const state = {
  history: [],
  last: null,
  focus: null, // uid of the zoomed-in node (null: the whole tree)
  colorBy: "hits",
  controller: null,
};

// ---------------------------------------------------------------- formatting
function fmtInt(n) { return n == null ? "–" : Math.round(n).toLocaleString("en-US"); }
function fmtRate(x) { return x == null ? "–" : x >= 100 ? fmtInt(x) : x.toFixed(1); }
function fmtPct(x) { return x == null ? "–" : (100 * x).toFixed(1) + "%"; }
function fmtMs(s) { return s == null ? "–" : s >= 1 ? s.toFixed(2) + " s" : (1000 * s).toFixed(s < 0.01 ? 1 : 0) + " ms"; }
function fmtAge(s) { return s < 1 ? "now" : s < 120 ? s.toFixed(0) + " s ago" : (s / 60).toFixed(0) + " min ago"; }
function text(id, value) { const el = $(id); if (el.textContent !== value) el.textContent = value; }

// ---------------------------------------------------------------- connection
function storedKey() { return localStorage.getItem(KEY_STORE); }

function setStatus(cls, label) {
  const el = $("status");
  el.className = "status " + cls;
  el.textContent = label;
}

function askKey(message) {
  $("auth").hidden = false;
  text("auth-error", message || "");
  $("api-key").focus();
}

$("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  localStorage.setItem(KEY_STORE, key);
  $("auth").hidden = true;
  connect();
});

$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(KEY_STORE);
  $("forget-key").hidden = true;
  if (state.controller) state.controller.abort();
  askKey("");
});

$("color-by").addEventListener("change", (ev) => {
  state.colorBy = ev.target.value;
  if (state.last) drawTree(state.last);
});

async function connect() {
  if (state.controller) state.controller.abort();
  const controller = new AbortController();
  state.controller = controller;
  const headers = { Accept: "text/event-stream" };
  const key = storedKey();
  if (key) headers.Authorization = "Bearer " + key;
  setStatus("connecting", "connecting…");
  let resp;
  try {
    resp = await fetch("/dashboard/stream", { headers, signal: controller.signal, cache: "no-store" });
  } catch (err) {
    if (controller.signal.aborted) return;
    setStatus("error", "disconnected, retrying");
    setTimeout(connect, 2000);
    return;
  }
  if (resp.status === 401) {
    setStatus("error", "API key needed");
    if (key) localStorage.removeItem(KEY_STORE);
    askKey(key ? "That key was refused." : "");
    return;
  }
  if (!resp.ok) {
    setStatus("error", "HTTP " + resp.status + ", retrying");
    setTimeout(connect, 2000);
    return;
  }
  $("forget-key").hidden = !key;
  setStatus("live", "live");
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) onPayload(JSON.parse(data));
      }
    }
  } catch (err) {
    if (controller.signal.aborted) return;
  }
  setStatus("error", "disconnected, retrying");
  setTimeout(connect, 2000);
}

// ---------------------------------------------------------------- payload
function onPayload(p) {
  if (p.history) state.history = p.history.slice();
  else state.history.push(p.point);
  if (state.history.length > 300) state.history.splice(0, state.history.length - 300);
  state.last = p;
  renderCards(p);
  drawTree(p);
  drawMemory();
  drawScheduler();
  renderRequests(p);
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

function renderCards(p) {
  const r = p.rates, m = p.memory, s = p.scheduler, c = p.counters;
  text("model", p.model);
  text("hit-rate", fmtPct(r.hit_rate_1m));
  text("hit-rate-total", fmtPct(r.hit_rate_total));
  text("prompt-tps", fmtRate(r.prompt_tok_per_s));
  text("output-tps", fmtRate(r.output_tok_per_s));
  text("computed-share", c.prompt_tokens ? fmtPct(c.computed_prompt_tokens / c.prompt_tokens) : "–");
  text("last-step", s.last_step_tokens + " tok, " + fmtMs(s.last_step_seconds));
  text("spec-accept", c.spec_draft_tokens
    ? fmtPct(c.spec_accepted_tokens / c.spec_draft_tokens) + ", " +
      (c.spec_accepted_tokens / c.spec_drafts).toFixed(2) + " per draft"
    : "– (no drafting)");
  text("ttft", fmtMs(r.ttft_p50) + " / " + fmtMs(r.ttft_p99));
  text("ttft-count", String(r.ttft_count));
  text("tpot", fmtMs(r.tpot_p50) + " / " + fmtMs(r.tpot_p99));
  text("tpot-count", String(r.tpot_count));
  text("num-running", String(s.num_running));
  text("num-waiting", String(s.num_waiting));
  text("max-running", String(s.max_running_requests));
  text("kv-pages", fmtInt(m.held_pages) + " / " + fmtInt(m.cached_pages) + " / " + fmtInt(m.free_pages));
  text("kv-total", fmtInt(m.total_pages));
  text("free-pages", fmtInt(m.free_pages));
  text("page-size", String(m.page_size));
  text("evict-rate", fmtRate(r.evictions_per_s));
  text("retract-rate", fmtRate(r.retractions_per_s));
  const t = p.tier;
  if (t) {
    text("tier-pages", fmtInt(t.pages) + " / " + (t.used_bytes / 1e6).toFixed(1) + " MB");
    text("tier-hits", fmtInt(t.hit_tokens));
    text("tier-load", fmtInt(t.loaded_pages) + " pages in " + fmtMs(t.load_seconds));
    text("tier-where", t.storage + (t.write_errors ? ", " + t.write_errors + " failed writes" : ""));
  }
}

// ---------------------------------------------------------------- tree (icicle)
function el(name, attrs, parent) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function nodeColor(n, maxHits) {
  if (n.state === "root") return "#eef1f5";
  let t;
  if (state.colorBy === "hits") t = maxHits > 0 ? Math.log1p(n.hits) / Math.log1p(maxHits) : 0;
  else t = Math.max(0, 1 - Math.log1p(n.last_access_age_s) / Math.log1p(600));
  // pale blue (cold / never hit) -> deep orange (hot / just used)
  const a = [214, 228, 245], b = [230, 110, 30];
  const mix = a.map((x, i) => Math.round(x + (b[i] - x) * t));
  return `rgb(${mix[0]},${mix[1]},${mix[2]})`;
}

function nodeLabel(n, showText) {
  if (n.state === "root") return "namespace " + n.namespace;
  if (showText && n.text != null) return JSON.stringify(n.text).slice(1, -1);
  return "#" + n.key_hash;
}

function describe(n, showText) {
  if (n.state === "root") {
    return `namespace ${n.namespace}: ${fmtInt(n.subtree_tokens)} cached tokens, ${fmtInt(n.hits)} lookups`;
  }
  const lines = [
    `${fmtInt(n.tokens)} tokens (${n.pages} pages) on this edge; prefix ${fmtInt(n.prefix_tokens)} tokens`,
    `subtree ${fmtInt(n.subtree_tokens)} tokens · hits ${fmtInt(n.hits)} · last access ${fmtAge(n.last_access_age_s)}`,
    `${n.state}${n.ref ? " (" + n.ref + " request" + (n.ref > 1 ? "s" : "") + ")" : ""} · namespace ${n.namespace} · token-id hash #${n.key_hash}`,
  ];
  if (n.other_children) lines.push(`${n.other_children} more children (${fmtInt(n.other_tokens)} tokens) not shown`);
  if (showText && n.text != null) lines.push("text: " + n.text);
  return lines.join("\n");
}

function drawTree(p) {
  const svg = $("tree");
  const W = svg.clientWidth || 900, rowH = 34;
  const nodes = p.tree.nodes;
  const byUid = new Map(nodes.map((n) => [n.uid, Object.assign({ kids: [] }, n)]));
  const tops = [];
  for (const n of byUid.values()) {
    if (n.parent == null) tops.push(n);
    else if (byUid.has(n.parent)) byUid.get(n.parent).kids.push(n);
  }
  if (state.focus != null && !byUid.has(state.focus)) state.focus = null;
  const maxHits = Math.max(0, ...nodes.filter((n) => n.state !== "root").map((n) => n.hits));
  const showText = p.show_text;
  const maxDepth = Math.max(0, ...nodes.map((n) => n.depth));
  svg.setAttribute("height", String(Math.max(120, (maxDepth + 1) * rowH + 8)));
  svg.replaceChildren();
  text("tree-meta", `${fmtInt(p.tree.num_nodes)} nodes, ${fmtInt(p.tree.tree_pages)} pages` +
    (p.tree.truncated ? " (top of the tree shown)" : ""));

  const roots = state.focus != null ? [byUid.get(state.focus)] : tops;
  const total = roots.reduce((s, n) => s + Math.max(n.subtree_tokens, 1), 0);
  const baseDepth = roots.length ? roots[0].depth : 0;
  let x0 = 0;
  for (const r of roots) {
    const w = (W * Math.max(r.subtree_tokens, 1)) / total;
    layout(r, x0, w, baseDepth);
    x0 += w;
  }
  renderCrumbs(byUid);

  function layout(n, x, w, depth0) {
    const y = (n.depth - depth0) * rowH + 4;
    const rect = el("rect", {
      x: x.toFixed(1), y, width: Math.max(w - 1, 0.5).toFixed(1), height: rowH - 4,
      class: `node state-${n.state}`, fill: nodeColor(n, maxHits),
      "data-uid": n.uid, "data-tokens": n.tokens, "data-prefix-tokens": n.prefix_tokens,
      "data-subtree-tokens": n.subtree_tokens, "data-hits": n.hits, "data-state": n.state,
      "data-namespace": n.namespace,
    }, svg);
    rect.addEventListener("mousemove", (ev) => showTip(ev, describe(n, showText)));
    rect.addEventListener("mouseleave", hideTip);
    rect.addEventListener("click", () => {
      state.focus = n.uid === state.focus ? n.parent : n.uid;
      if (state.focus != null && !byUid.has(state.focus)) state.focus = null;
      drawTree(state.last);
    });
    if (w > 60) {
      const label = n.state === "root" ? nodeLabel(n, showText)
        : `${fmtInt(n.tokens)} tok · ${fmtInt(n.hits)} hits · ${nodeLabel(n, showText)}`;
      const t = el("text", { x: (x + 4).toFixed(1), y: y + 19 }, svg);
      t.textContent = label.slice(0, Math.floor(w / 6.2));
    }
    const denom = Math.max(n.subtree_tokens, 1);
    let cx = x + (w * n.tokens) / denom; // a node's own tokens sit left of its children
    if (n.state === "root") cx = x;
    for (const k of n.kids) {
      const kw = (w * k.subtree_tokens) / denom;
      layout(k, cx, kw, depth0);
      cx += kw;
    }
    if (n.other_tokens > 0) {
      const ow = (w * n.other_tokens) / denom;
      const more = el("rect", { x: cx.toFixed(1), y: y + rowH, width: Math.max(ow - 1, 0.5).toFixed(1),
        height: rowH - 4, class: "more" }, svg);
      more.addEventListener("mousemove", (ev) => showTip(ev,
        `${n.other_children} more children, ${fmtInt(n.other_tokens)} tokens (not in the summary)`));
      more.addEventListener("mouseleave", hideTip);
    }
  }
}

function renderCrumbs(byUid) {
  const box = $("tree-focus");
  box.replaceChildren();
  if (state.focus == null) return;
  const chain = [];
  for (let n = byUid.get(state.focus); n; n = byUid.get(n.parent)) chain.unshift(n);
  const all = document.createElement("span");
  all.textContent = "whole tree";
  all.onclick = () => { state.focus = null; drawTree(state.last); };
  box.append("zoom: ", all);
  for (const n of chain) {
    const s = document.createElement("span");
    s.textContent = n.state === "root" ? n.namespace : "#" + n.key_hash;
    s.onclick = () => { state.focus = n.uid; drawTree(state.last); };
    box.append(" › ", s);
  }
}

function showTip(ev, msg) {
  const tip = $("tooltip");
  tip.textContent = msg;
  tip.hidden = false;
  tip.style.left = ev.clientX + 14 + "px";
  tip.style.top = ev.clientY + 14 + "px";
  text("node-detail", msg.split("\n").join(" · "));
}
function hideTip() { $("tooltip").hidden = true; }

// ---------------------------------------------------------------- charts
function chart(svgId, series, opts) {
  const svg = $(svgId);
  const W = svg.clientWidth || 500, H = svg.clientHeight || 150, pad = 4, left = 40;
  svg.replaceChildren();
  const h = state.history;
  if (h.length < 1) return;
  const n = h.length;
  const xs = (i) => left + ((W - left - pad) * (n === 1 ? 1 : i / (n - 1)));
  const stackedTotals = h.map((pt) => series.reduce((s, se) => s + (se.get(pt) || 0), 0));
  let ymax = Math.max(opts.min || 1, ...(opts.stacked ? stackedTotals : series.flatMap((se) => h.map(se.get))));
  if (opts.cap) ymax = Math.min(ymax, Math.max(opts.min || 1, ...h.map(opts.cap)));
  const ys = (v) => H - pad - 12 - ((H - 2 * pad - 12) * v) / ymax;
  const grid = el("text", { x: 2, y: 12 }, svg); grid.textContent = fmtRate(ymax);
  const zero = el("text", { x: 2, y: H - 14 }, svg); zero.textContent = "0";
  const span = el("text", { x: left, y: H - 2 }, svg);
  span.textContent = n > 1 ? `last ${Math.round(h[n - 1].t - h[0].t)} s` : "";
  el("line", { x1: left, x2: W - pad, y1: ys(0), y2: ys(0), stroke: "#d9dce1" }, svg);
  let base = h.map(() => 0);
  for (const se of series) {
    const top = h.map((pt, i) => (opts.stacked ? base[i] : 0) + (se.get(pt) || 0));
    let d = top.map((v, i) => `${i ? "L" : "M"}${xs(i).toFixed(1)},${ys(v).toFixed(1)}`).join("");
    if (opts.stacked) {
      const back = base.map((v, i) => `L${xs(i).toFixed(1)},${ys(v).toFixed(1)}`).reverse().join("");
      el("path", { d: d + back + "Z", fill: se.color, "fill-opacity": 0.85, stroke: "none" }, svg);
      base = top;
    } else {
      el("path", { d, fill: "none", stroke: se.color, "stroke-width": 2 }, svg);
    }
  }
}

function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

function drawMemory() {
  // Free pages dwarf the rest on a big pool: the axis stops a little above the pages in use
  // (the free band runs off the top), and the free count is printed under the chart.
  chart("memory-chart", [
    { get: (p) => p.held, color: cssVar("--held") },
    { get: (p) => p.cached, color: cssVar("--cached") },
    { get: (p) => p.free, color: cssVar("--free") },
  ], { stacked: true, min: 8, cap: (p) => Math.ceil(1.3 * (p.held + p.cached)) });
  chart("events-chart", [
    { get: (p) => p.evictions_per_s, color: cssVar("--evict") },
    { get: (p) => p.retractions_per_s, color: cssVar("--retract") },
  ], { stacked: false, min: 1 });
}

function drawScheduler() {
  chart("sched-chart", [
    { get: (p) => p.running, color: cssVar("--running") },
    { get: (p) => p.waiting, color: cssVar("--waiting") },
  ], { stacked: false, min: 1 });
}

function renderRequests(p) {
  const body = document.querySelector("#requests tbody");
  const rows = p.scheduler.requests.map((r) => {
    const tr = document.createElement("tr");
    let st = r.state;
    if (st === "prefill") st = `prefill chunk ${r.chunk} of ${r.num_chunks}`;
    else if (st === "grammar") st = "waiting for grammar";
    const cells = [
      r.request_id.slice(0, 16) + (r.index ? "/" + r.index : ""), st, fmtInt(r.prompt_tokens),
      fmtInt(r.cached_tokens), fmtInt(r.computed_prompt_tokens), fmtInt(r.output_tokens), r.age_s.toFixed(1) + " s",
    ];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = c;
      if (i === 1) td.className = "state-" + r.state;
      tr.appendChild(td);
    });
    tr.dataset.state = r.state;
    return tr;
  });
  body.replaceChildren(...rows);
  const shown = p.scheduler.requests.length;
  const all = p.scheduler.num_running + p.scheduler.num_waiting;
  text("requests-more", all > shown ? `${all - shown} more not listed` : "");
}

connect();
