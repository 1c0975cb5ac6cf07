// The flowspec_p2p dashboard: renders the state the leader pushes on /dashboard/events (api/dashboard.py) and
// chats through /v1/chat/completions. Plain DOM, no libraries, nothing loaded from elsewhere.
"use strict";

const $ = (sel) => document.querySelector(sel);
const PALETTE = ["#2f6fec", "#16a34a", "#d97706", "#9333ea", "#db2777", "#0891b2", "#65a30d", "#dc2626"];
// An API key, when the cluster has one: ?key=... once (kept in this browser), sent as a bearer token.
const API_KEY = (() => {
  const fromUrl = new URLSearchParams(location.search).get("key");
  if (fromUrl) localStorage.setItem("flowspec.apiKey", fromUrl);
  return fromUrl || localStorage.getItem("flowspec.apiKey") || "";
})();

const view = { state: null, colors: new Map(), updates: 0, modesShown: "" };
const chat = { messages: [], busy: false };

// ------------------------------------------------------------------------------------------------ helpers

function h(tag, attrs, ...children) {
  const svg = ["svg", "g", "circle", "line", "path", "text", "marker", "defs", "polygon"].includes(tag);
  const el = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "style") Object.assign(el.style, v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function fill(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

function num(x, digits = 2) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

function colorOf(agentId) {
  if (!view.colors.has(agentId)) view.colors.set(agentId, PALETTE[view.colors.size % PALETTE.length]);
  return view.colors.get(agentId);
}

function headers(extra) {
  const out = { ...(extra || {}) };
  if (API_KEY) out.Authorization = `Bearer ${API_KEY}`;
  return out;
}

// Server-sent events from a fetch response (fetch, not EventSource, so an API key can go in a header).
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// ------------------------------------------------------------------------------------------------ state

function members(state) {
  return (state.cluster && state.cluster.members) || [];
}

function memberName(state, id) {
  const m = members(state).find((x) => x.id === id);
  return m ? (m.name || id) : id;
}

function renderHeader(state) {
  const c = state.cluster || {};
  const ready = state.leader.ready;
  const status = $("#status");
  let text = "serving", cls = "ok";
  if (c.transition) { text = `re-planning (${c.transition.phase})`; cls = "warn"; }
  else if (c.broken) { text = "pipeline broken"; cls = "bad"; }
  else if (c.no_plan && !ready) { text = c.no_plan.split(":").slice(0, 2).join(":"); cls = "bad"; }
  else if (!ready) { text = "planning"; cls = "warn"; }
  status.textContent = text;
  status.title = c.no_plan || "";
  status.className = `pill ${cls}`;
  $("#cluster-name").textContent = c.cluster ? `· cluster ${c.cluster}` : "";
  $("#epoch").textContent = c.epoch ?? "–";
  $("#model").textContent = c.plan ? `${c.plan.model} · ${c.plan.num_layers} layers` : "";
}

function ringOrder(state) {
  const plan = state.cluster && state.cluster.plan;
  return plan ? plan.stages.map((s) => s.agent_id) : [];
}

function renderTopology(state) {
  const svg = $("#topology");
  const all = members(state);
  const leader = all.find((m) => m.role === "leader");
  const ring = ringOrder(state);
  const ordered = [];
  if (leader && !ring.includes(leader.id)) ordered.push(leader.id);
  ordered.push(...ring);
  for (const m of all) if (!ordered.includes(m.id)) ordered.push(m.id);
  const W = 640, H = 300, cx = W / 2, cy = H / 2 + 6, rx = 230, ry = 100;
  const pos = new Map();
  ordered.forEach((id, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, ordered.length);
    pos.set(id, [cx + rx * Math.cos(a), cy + ry * Math.sin(a)]);
  });
  const counters = new Map(((state.cluster && state.cluster.stages) || []).map((s) => [s.agent_id, s.counters]));
  const hops = [];
  if (leader && ring.length) {
    const path = ring[0] === leader.id ? [...ring, leader.id] : [leader.id, ...ring, leader.id];
    for (let i = 0; i + 1 < path.length; i++) if (path[i] !== path[i + 1]) hops.push([path[i], path[i + 1]]);
  }
  const defs = h("defs", {}, h("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5",
    markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" }, h("path", { d: "M0,0 L10,5 L0,10 z",
    fill: "#9aa3b5" })));
  const edges = hops.map(([a, b]) => {
    const [x1, y1] = pos.get(a), [x2, y2] = pos.get(b);
    const d = Math.hypot(x2 - x1, y2 - y1) || 1, r = 26;
    const sx = x1 + ((x2 - x1) * r) / d, sy = y1 + ((y2 - y1) * r) / d;
    const ex = x2 - ((x2 - x1) * r) / d, ey = y2 - ((y2 - y1) * r) / d;
    const sent = counters.get(a) && counters.get(a).sent_bytes;
    return h("g", { class: "link", dataset: { from: a, to: b } },
      h("line", { class: "edge", x1: sx, y1: sy, x2: ex, y2: ey, "marker-end": "url(#arrow)" }),
      sent ? h("text", { class: "edge-label", x: (sx + ex) / 2, y: (sy + ey) / 2 - 4 }, bytes(sent)) : null);
  });
  const plan = state.cluster && state.cluster.plan;
  const nodes = ordered.map((id) => {
    const m = all.find((x) => x.id === id);
    const stage = plan ? plan.stages.find((s) => s.agent_id === id) : null;
    const [x, y] = pos.get(id);
    const idle = !stage && !(m && m.role === "leader");
    const sub = stage ? `layers ${stage.layers.start}–${stage.layers.end - 1}` : (m && m.role === "leader" ?
      "embed · head · draft" : "idle");
    return h("g", { class: `node${idle ? " idle" : ""}`, dataset: { id, role: m ? m.role : "" } },
      h("circle", { cx: x, cy: y, r: m && m.role === "leader" ? 24 : 20, fill: colorOf(id) }),
      h("text", { x, y: y + 40 }, `${m ? m.name || id : id}${m && m.role === "leader" ? " ★" : ""}`),
      h("text", { class: "sub", x, y: y + 53 }, sub));
  });
  fill(svg, defs, edges, nodes);
}

function renderMembers(state) {
  const plan = state.cluster && state.cluster.plan;
  const counters = new Map(((state.cluster && state.cluster.stages) || []).map((s) => [s.agent_id, s.counters]));
  const rows = members(state).map((m) => {
    const p = m.profile || {};
    const stage = plan ? plan.stages.find((s) => s.agent_id === m.id) : null;
    const c = counters.get(m.id) || {};
    const link = p.link_mbps ? `${num(p.link_mbps, 0)} Mbit/s${p.latency_ms ? `, ${num(p.latency_ms, 1)} ms` : ""}`
      : "–";
    return h("tr", { class: "member", dataset: { id: m.id, role: m.role } },
      h("td", {}, h("span", { class: "swatch", style: { background: colorOf(m.id) } }), m.name || m.id,
        h("span", { class: "dim" }, ` ${m.id.slice(0, 6)}`)),
      h("td", {}, m.role), h("td", {}, (m.address || "").replace(/^https?:\/\//, "")),
      h("td", {}, bytes(p.memory_bytes)), h("td", {}, `${num(p.gflops, 1)} GF/s`), h("td", {}, link),
      h("td", {}, m.state + (m.failed ? ` (${m.failed} failed)` : "")),
      h("td", {}, stage ? `${stage.layers.start}–${stage.layers.end - 1}` : "–"),
      h("td", {}, bytes(c.rss_bytes)));
  });
  fill($("#members tbody"), rows);
}

function planSegments(stages, numLayers, withLabels) {
  return stages.map((s) => {
    const n = s.layers.end - s.layers.start;
    const label = withLabels ? [h("b", {}, memberName(view.state, s.agent_id)),
      h("span", {}, `L${s.layers.start}–${s.layers.end - 1} · ${bytes(s.memory_bytes)}`)] : [];
    return h("div", { class: "plan-seg", dataset: { agent: s.agent_id },
      title: `${memberName(view.state, s.agent_id)}: layers ${s.layers.start}–${s.layers.end - 1}`,
      style: { flexGrow: String(Math.max(n, 0.2)), flexBasis: "0", background: colorOf(s.agent_id) } }, label);
  });
}

function renderPlan(state) {
  const plan = state.cluster && state.cluster.plan;
  if (!plan) {
    fill($("#plan-bar"));
    $("#plan-summary").textContent = (state.cluster && state.cluster.no_plan) || "no plan yet";
    return;
  }
  fill($("#plan-bar"), planSegments(plan.stages, plan.num_layers, true));
  $("#plan-summary").textContent = `${plan.stages.length} stage(s) · bottleneck ${num(plan.bottleneck_ms, 1)} ms` +
    ` · round trip ${num(plan.round_trip_ms, 1)} ms`;
  const excluded = (plan.excluded || []).map((e) => `${memberName(state, e.agent_id)}: ${e.reason}`);
  fill($("#plan-legend"), `leader ${memberName(state, plan.leader_id)} holds embedding, LM head and draft head ` +
    `(${bytes(plan.leader_memory_bytes)})`, excluded.length ? ` · left out: ${excluded.join("; ")}` : "");
  const history = ((state.cluster && state.cluster.recoveries) || []).slice().reverse();
  fill($("#plan-history"), history.map((r) => {
    const when = r.at ? new Date(r.at * 1000).toLocaleTimeString() : "";
    return h("li", { dataset: { epoch: r.epoch } },
      h("b", {}, `epoch ${r.epoch}`), ` ${when} · ${r.trigger} · serving after ${num(r.seconds, 2)} s`,
      h("span", { class: "dim" }, ` (detect+plan ${num(r.detect_plan_s, 2)} s, load ${num(r.load_s, 2)} s, ` +
        `switch ${num(r.switch_s, 2)} s)`),
      r.stages ? h("div", { class: "mini" }, planSegments(r.stages, plan.num_layers, false)) : null);
  }));
}

function tile(k, v) {
  return h("div", { class: "tile" }, h("div", { class: "v" }, v), h("div", { class: "k" }, k));
}

function bar(label, frac, value) {
  return h("div", { class: "row" }, h("span", { class: "label" }, label),
    h("span", { class: "track" }, h("span", { class: "fill", style: {
      width: `${Math.round(100 * Math.max(0, Math.min(1, frac)))}%`, display: "block" } })),
    h("span", { class: "val" }, value));
}

function renderRequest(state) {
  const r = state.request, L = state.leader;
  $("#request-title").textContent = r ? `${r.mode} · ${r.running ? "running" : r.outcome} · ${r.id}` : "none yet";
  fill($("#tiles"),
    tile("tokens/s", num(r && r.tokens_per_s, 1)), tile("τ (tokens per walk)", num(r && r.tau, 2)),
    tile("tokens", r ? r.tokens : "–"), tile("first token", r && r.ttft_s !== null ? `${num(r.ttft_s, 2)} s` : "–"),
    tile("queue depth", L.waiting), tile("in flight", `${L.in_flight.length} of ${L.admission.max_requests}`),
    tile("queue wait (mean)", `${num(L.admission.mean_wait_s, 2)} s`),
    tile("prompt cache", `${L.prompt_cache.entries} kept · ${L.prompt_cache.hits} hits`),
    tile("resumes", r ? `${r.resumes} (all: ${L.resumed})` : L.resumed),
    tile("ring trip", r && r.trip_ms !== null ? `${num(r.trip_ms, 1)} ms` : "–"));
  const depth = (r && r.acceptance_by_depth) || [];
  fill($("#depth"), depth.length ? depth.map((p, i) => bar(`depth ${i + 1}`, p, `${Math.round(100 * p)}%`))
    : h("span", { class: "dim" }, r && r.walks === 0 ? "no draft walks (autoregressive)" : "–"));
  const stages = (r && r.stages) || [];
  fill($("#stage-busy"), stages.length ? stages.map((s) => bar(`stage ${s.stage}`, s.busy,
    `${Math.round(100 * s.busy)}% · ${num(s.bubble_s, 2)} s idle`)) : h("span", { class: "dim" }, "–"));
  const live = state.in_flight || [];
  fill($("#in-flight"), live.length ? h("table", {},
    h("tr", {}, ...["request", "mode", "tokens", "tokens/s", "first token", "queued", "cached"].map((c) => h("th", {}, c))),
    ...live.map((x) => h("tr", {}, h("td", {}, x.id), h("td", {}, x.mode), h("td", {}, String(x.tokens)),
      h("td", {}, num(x.tokens_per_s, 1)), h("td", {}, x.ttft_s === null ? "–" : `${num(x.ttft_s, 2)} s`),
      h("td", {}, `${num(x.queued_s, 2)} s`), h("td", {}, String(x.cached_tokens)))))
    : h("span", { class: "dim" }, "none"));
  const rows = (state.stage_rows || []).filter((s) => s.rows_per_forward !== null);
  fill($("#stage-rows"), rows.length ? rows.map((s) => `stage ${s.stage}: ${num(s.rows_per_forward, 1)} rows per ` +
    `forward, ${s.batched_forwards} batched`).join(" · ") : "");
  fill($("#recent"), (state.recent || []).length ? "before: " : "", (state.recent || []).map((x) =>
    `${x.mode} ${x.tokens} tok ${num(x.tokens_per_s, 1)}/s${x.tau ? ` τ ${num(x.tau, 2)}` : ""}`).join(" · "));
}

function renderTimeline(state) {
  const canvas = $("#timeline");
  const dpr = window.devicePixelRatio || 1;
  const W = canvas.clientWidth || 640, H = canvas.clientHeight || 150;
  if (canvas.width !== Math.round(W * dpr)) { canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, H);
  const t = state.timeline || { stages: [], leader: [] };
  const rows = [{ label: "leader", color: "#1d2330", intervals: t.leader },
    ...t.stages.map((s) => ({ label: `${s.stage} ${s.name || s.agent_id}`, color: colorOf(s.agent_id),
      intervals: s.intervals }))];
  const left = 92, right = W - 8, top = 6, rowH = Math.min(24, (H - top - 18) / Math.max(1, rows.length));
  // the current (or last) request fills the chart while it is in the window; else the whole window
  const r = state.request;
  let t0 = state.now - state.window_s, t1 = state.now;
  if (r && r.started > t0) {
    const end = r.running ? state.now : Math.min(state.now, r.started + r.elapsed_s);
    const pad = Math.max(0.2, 0.05 * (end - r.started));
    t0 = r.started - pad;
    t1 = Math.min(state.now, end + pad);
  }
  const x = (ts) => left + ((ts - t0) / (t1 - t0)) * (right - left);
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  rows.forEach((row, i) => {
    const y = top + i * rowH;
    ctx.fillStyle = "#e8ebf1";
    ctx.fillRect(left, y + 3, right - left, rowH - 6);
    ctx.fillStyle = "#6b7383";
    ctx.fillText(row.label.slice(0, 14), 4, y + rowH / 2);
    ctx.fillStyle = row.color;
    for (const [a, b] of row.intervals || []) {
      if (b < t0) continue;
      const xa = Math.max(left, x(a));
      ctx.fillRect(xa, y + 3, Math.max(1, x(b) - xa), rowH - 6);
    }
  });
  if (r && r.started > t0) {
    ctx.strokeStyle = "#dc2626";
    ctx.beginPath(); ctx.moveTo(x(r.started), top); ctx.lineTo(x(r.started), top + rows.length * rowH); ctx.stroke();
  }
  ctx.fillStyle = "#6b7383";
  // seconds after the request's arrival when the chart shows the request, else before now
  const zero = r && r.started > state.now - state.window_s ? r.started : t1;
  const span = t1 - t0, step = [0.1, 0.25, 0.5, 1, 2, 5, 10].find((s) => span / s <= 8) || 10;
  for (let k = Math.ceil((t0 - zero) / step); zero + k * step <= t1; k++) {
    const label = (k * step).toFixed(step < 1 ? 2 : 0);
    ctx.fillText(`${k > 0 && zero !== t1 ? "+" : ""}${label}s`, x(zero + k * step) - 12, H - 8);
  }
  $("#timeline-window").textContent = r && r.started > state.now - state.window_s
    ? "busy intervals of the request (red line: its arrival)" : `busy intervals, last ${state.window_s} s`;
}

function renderModes(state) {
  const modes = state.leader.modes || [];
  const key = modes.join(",");
  if (key === view.modesShown) return;
  view.modesShown = key;
  fill($("#chat-mode"), modes.map((m) => h("option", { value: m, selected: m === state.leader.default_mode }, m)));
}

function render(state) {
  view.state = state;
  view.updates += 1;
  document.body.dataset.updates = String(view.updates);
  renderHeader(state);
  renderTopology(state);
  renderMembers(state);
  renderPlan(state);
  renderRequest(state);
  renderTimeline(state);
  renderModes(state);
}

async function follow() {
  for (;;) {
    try {
      const resp = await fetch("/dashboard/events", { headers: headers() });
      if (!resp.ok) throw new Error(`${resp.status} ${resp.statusText}`);
      $("#conn").textContent = "● live";
      for await (const ev of events(resp)) if (ev.event === "state") render(JSON.parse(ev.data));
    } catch (e) {
      $("#conn").textContent = `○ offline (${e.message || e})`;
    }
    $("#conn").textContent = "○ reconnecting";
    await new Promise((r) => setTimeout(r, 1000));
  }
}

// ------------------------------------------------------------------------------------------------- chat

function say(role, text) {
  const el = h("div", { class: `msg ${role}` }, text);
  $("#chat-log").append(el);
  $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
  return el;
}

async function send(text) {
  if (chat.busy || !text.trim()) return;
  chat.busy = true;
  $("#chat-send").disabled = true;
  chat.messages.push({ role: "user", content: text });
  say("user", text);
  const out = say("assistant", "");
  out.dataset.chunks = "0";
  const body = chatBody();
  let reply = "", stats = null, failed = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers({
      "Content-Type": "application/json" }), body: JSON.stringify(body) });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `${resp.status} ${resp.statusText}`);
    }
    for await (const ev of events(resp)) {
      if (ev.data === "[DONE]") break;
      const obj = JSON.parse(ev.data);
      if (obj.error) { failed = obj.error.message; continue; }
      for (const choice of obj.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          reply += piece;
          out.textContent = reply;
          out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
          $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
        }
      }
      if (obj.stats) stats = obj.stats;
    }
  } catch (e) {
    failed = e.message || String(e);
  }
  if (failed) {
    out.classList.add("error");
    out.textContent = reply + (reply ? "\n" : "") + `error: ${failed}`;
  } else {
    chat.messages.push({ role: "assistant", content: reply });
  }
  if (stats) {
    const tps = stats.decode_tokens_per_s;
    out.append(h("span", { class: "stats" }, `${stats.mode} · ${stats.new_tokens} tokens · τ ${num(stats.tau, 2)} · ` +
      `${tps ? `${num(tps, 1)} tokens/s · ` : ""}prefill ${num(stats.prefill_s, 2)} s · decode ${num(stats.decode_s, 2)} s` +
      (stats.resumed ? ` · resumed ${stats.resumed}×` : "")));
  }
  out.classList.add("done");
  chat.busy = false;
  $("#chat-send").disabled = false;
}

function chatBody() {
  const max = Number($("#chat-max").value) || 96, temp = Number($("#chat-temp").value) || 0;
  return { messages: chat.messages, stream: true, max_tokens: max, temperature: temp,
    decoding: $("#chat-mode").value || undefined };
}

function setupChat() {
  $("#chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("#chat-input").value;
    $("#chat-input").value = "";
    send(text);
  });
  $("#chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("#chat-form").requestSubmit(); }
  });
  $("#chat-clear").addEventListener("click", () => { chat.messages = []; fill($("#chat-log")); });
}

setupChat();
follow();
