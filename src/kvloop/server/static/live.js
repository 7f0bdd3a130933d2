// kvloop's live page: draws the engine's LiveFeed (GET /live/events) and sends prompts
// to the server's own /v1 streaming endpoints. Plain browser JavaScript, no build step.
"use strict";

const MAX_STEPS = 150; // steps drawn in the timeline
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

const state = {
  info: null,
  steps: [],      // newest last
  requests: [],
  kv: null,
  roofline: null,
  updates: 0,     // events received
};
// Tests and curious users read the page's state from here.
window.kvloopLive = state;

// --- numbers ------------------------------------------------------------------------------
function si(x, unit) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  const prefixes = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [f, p] of prefixes) if (Math.abs(x) >= f) return (x / f).toFixed(2) + " " + p + unit;
  return x.toFixed(1) + " " + unit;
}
function bytes(x) {
  if (x === null || x === undefined) return "–";
  const units = [[2 ** 30, "GiB"], [2 ** 20, "MiB"], [2 ** 10, "KiB"]];
  for (const [f, u] of units) if (x >= f) return (x / f).toFixed(1) + " " + u;
  return x + " B";
}
function hue(name) { // a stable colour per request id
  let h = 0;
  for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
  return h % 360;
}

// --- the event stream ---------------------------------------------------------------------
function connect() {
  const source = new EventSource("/live/events");
  source.addEventListener("info", (e) => {
    state.info = JSON.parse(e.data);
    $("model").textContent = state.info.model;
    $("key-label").hidden = !state.info.api_key_required;
    $("api-key").value = sessionStorage.getItem("kvloopKey") || "";
    $("status").textContent = "live";
    $("status").className = "badge live";
  });
  source.addEventListener("message", (e) => update(JSON.parse(e.data)));
  source.addEventListener("end", () => {
    $("status").textContent = "server shut down";
    $("status").className = "badge down";
    source.close();
  });
  source.onerror = () => { // EventSource reconnects by itself; say so meanwhile
    $("status").textContent = "reconnecting…";
    $("status").className = "badge down";
  };
  source.onopen = () => { $("status").textContent = "live"; $("status").className = "badge live"; };
}

function update(u) {
  state.updates++;
  if (u.steps.length) {
    state.steps.push(...u.steps);
    if (state.steps.length > MAX_STEPS) state.steps.splice(0, state.steps.length - MAX_STEPS);
  }
  state.requests = u.requests;
  if (u.kv) state.kv = u.kv;
  state.roofline = u.roofline;
  drawSteps();
  drawRequests();
  drawKV();
  drawRoofline();
  state.version = u.version;
}

// --- the timeline -------------------------------------------------------------------------
function drawSteps() {
  const svg = $("timeline");
  const steps = state.steps;
  const W = 600, H = 160, n = MAX_STEPS, bw = W / n;
  const maxTok = Math.max(1, ...steps.map((s) => s.prefill + s.decode));
  const maxMs = Math.max(1, ...steps.map((s) => s.ms));
  const maxBatch = Math.max(1, ...steps.map((s) => s.batch));
  const parts = [];
  const x0 = W - steps.length * bw;
  // Tokens on a square-root scale: a 500-token prefill must not flatten the decode steps.
  const y = (v) => H * Math.sqrt(v / maxTok);
  steps.forEach((s, i) => {
    const x = x0 + i * bw;
    const hd = y(s.decode), ht = y(s.prefill + s.decode);
    parts.push(`<rect x="${x}" y="${H - hd}" width="${bw * 0.9}" height="${hd}" fill="var(--decode)"/>`);
    if (s.prefill) parts.push(`<rect x="${x}" y="${H - ht}" width="${bw * 0.9}" height="${ht - hd}" fill="var(--prefill)"/>`);
    if (s.drafted) {
      parts.push(`<rect x="${x}" y="${H - y(s.drafted)}" width="${bw * 0.45}" height="${y(s.drafted)}" fill="var(--drafted)"/>`);
      parts.push(`<rect x="${x + bw * 0.45}" y="${H - y(s.accepted)}" width="${bw * 0.45}" height="${y(s.accepted)}" fill="var(--accepted)"/>`);
    }
  });
  const line = (key, max, colour) => steps.length < 2 ? "" :
    `<polyline fill="none" stroke="${colour}" stroke-width="1.2" vector-effect="non-scaling-stroke" points="` +
    steps.map((s, i) => `${x0 + (i + 0.45) * bw},${H - (H - 8) * s[key] / max}`).join(" ") + `"/>`;
  parts.push(line("ms", maxMs, "#e6e9ec"), line("batch", maxBatch, "#ff5c8a"));
  svg.innerHTML = parts.join("");
  svg.dataset.steps = String(steps.length);
  const last = steps[steps.length - 1];
  if (last) {
    $("step-index").textContent = last.i;
    $("step-ms").textContent = last.ms.toFixed(1);
    $("step-batch").textContent = last.batch;
  }
}

// --- the requests -------------------------------------------------------------------------
function drawRequests() {
  const body = document.querySelector("#requests tbody");
  const rows = state.requests.slice().sort((a, b) => b.arrival - a.arrival);
  body.innerHTML = "";
  let running = 0;
  for (const r of rows) {
    if (r.phase !== "finished") running++;
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    tr.dataset.phase = r.phase;
    const cells = [r.id, r.phase + (r.finish_reason ? ` (${r.finish_reason})` : ""), r.prefilled,
      r.tokens, r.ttft_s === null ? "–" : (r.ttft_s * 1e3).toFixed(0) + " ms",
      r.tokens_per_s === null ? "–" : r.tokens_per_s.toFixed(1)];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = String(c);
      if (i === 1) td.className = "phase-" + r.phase;
      if (i === 0) td.style.color = `hsl(${hue(r.id)} 70% 65%)`;
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  $("num-running").textContent = running;
}

// --- the KV block pool --------------------------------------------------------------------
function drawKV() {
  const kv = state.kv;
  const canvas = $("kv-grid");
  const total = kv ? kv.states.length : (state.info ? state.info.num_blocks : 0);
  const states = kv ? kv.states : "f".repeat(total); // no step yet: all free
  const cols = Math.ceil(Math.sqrt(total * 5)), rows = Math.ceil(total / cols);
  const cell = Math.max(2, Math.floor(600 / cols));
  canvas.width = cols * cell;
  canvas.height = Math.max(cell, rows * cell);
  const ctx = canvas.getContext("2d");
  const css = getComputedStyle(document.documentElement);
  const colour = { f: css.getPropertyValue("--free"), c: css.getPropertyValue("--cached"),
                   s: css.getPropertyValue("--shared") };
  const counts = { f: 0, c: 0, u: 0, s: 0 };
  for (let i = 0; i < total; i++) {
    const st = states[i];
    counts[st]++;
    if (st === "u") {
      const owner = kv.owners[kv.owner_of[i]] || "";
      ctx.fillStyle = `hsl(${hue(owner)} 70% 55%)`;
    } else {
      ctx.fillStyle = colour[st];
    }
    ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
  }
  const used = counts.u + counts.s;
  canvas.dataset.used = String(used);
  canvas.dataset.step = kv ? String(kv.step) : "-1";
  $("kv-used").textContent = used;
  $("kv-shared").textContent = counts.s;
  $("kv-cached").textContent = counts.c;
  $("kv-free").textContent = counts.f;
  $("kv-total").textContent = total;
  const perBlock = kv ? kv.bytes_per_block : (state.info ? state.info.bytes_per_block : 0);
  $("kv-bytes").textContent = `${bytes(used * perBlock)} of ${bytes(total * perBlock)}`;
}

// --- the roofline -------------------------------------------------------------------------
function drawRoofline() {
  const r = state.roofline;
  if (!r) return;
  const gauge = (bar, label, achieved, limit, unit) => {
    if (achieved === null) { $(label).textContent = "–"; $(bar).style.width = "0"; return null; }
    if (limit === null) {
      $(label).textContent = `${si(achieved, unit)} (limit not measured)`;
      $(bar).style.width = "0";
      return null;
    }
    const f = achieved / limit;
    $(bar).style.width = Math.min(100, 100 * f).toFixed(1) + "%";
    $(label).textContent = `${si(achieved, unit)} of ${si(limit, unit)} (${(100 * f).toFixed(0)}%)`;
    return f;
  };
  const fb = gauge("roof-bw-bar", "roof-bw", r.bytes_per_s, r.bandwidth, "B/s");
  const ff = gauge("roof-flops-bar", "roof-flops", r.flops_per_s, r.peak_flops, "FLOP/s");
  $("roof-bound").textContent = fb === null || ff === null ? "not measured (kvloop serve --measure-machine)"
    : fb >= ff ? "memory-bound" : "compute-bound";
}

// --- sending a prompt ---------------------------------------------------------------------
async function send(event) {
  event.preventDefault();
  const reply = $("reply");
  const mode = $("mode").value;
  const text = $("prompt").value;
  const body = {
    model: state.info ? state.info.model : "default",
    stream: true,
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if (mode === "chat") body.messages = [{ role: "user", content: text }];
  else body.prompt = text;
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value;
  if (key) { headers.Authorization = "Bearer " + key; sessionStorage.setItem("kvloopKey", key); }
  reply.textContent = "";
  reply.classList.remove("error");
  $("send").disabled = true;
  try {
    const url = mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
    const resp = await fetch(url, { method: "POST", headers, body: JSON.stringify(body) });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${resp.status}`);
    }
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      reply.textContent += mode === "chat" ? (choice.delta.content || "") : (choice.text || "");
    });
    reply.dataset.done = "1";
  } catch (e) {
    reply.classList.add("error");
    reply.textContent += "\n" + e.message;
  } finally {
    $("send").disabled = false;
  }
}

// The OpenAI stream: "data: {json}" events, ended by "data: [DONE]".
async function readEvents(resp, onChunk) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

$("prompt-form").addEventListener("submit", send);
drawKV();
connect();
