// The page at /: a chat with the served model, and the engine as it runs, pushed by /api/live.
"use strict";
import { colour, el, fmt, getJSON, readEvents, request } from "./common.js";

const $ = (id) => document.getElementById(id);
const info = { model: "", context: 2048 };
const mine = new Set();                 // engine ids of this tab's requests (the live view shows ids only)

// ---- chat ------------------------------------------------------------------------------------------
const chat = { messages: [], controller: null };

function bubble(role, text) {
  const node = el("div", { class: `message ${role}` }, el("span", { class: "role", text: role }), el("span", { class: "text", text }));
  $("messages").append(node);
  $("messages").scrollTop = $("messages").scrollHeight;
  return node;
}

function sampling() {
  return { temperature: Number($("temperature").value), top_p: Number($("top-p").value),
           max_tokens: Number($("max-tokens").value) };
}

async function send(text) {
  chat.messages.push({ role: "user", content: text });
  bubble("user", text);
  const answer = bubble("assistant", "");
  const out = answer.querySelector(".text");
  chat.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("chat-status").textContent = "waiting for the first token…";
  let reply = "";
  try {
    const response = await request("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, signal: chat.controller.signal,
      body: JSON.stringify({ model: info.model, messages: chat.messages, stream: true,
                             stream_options: { include_usage: true }, ...sampling() }),
    });
    const rid = Number(response.headers.get("x-minillm-request-id"));
    if (!Number.isNaN(rid)) { mine.add(rid); answer.dataset.requestId = String(rid); }
    answer.classList.add("streaming");
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        out.textContent = reply;
        $("messages").scrollTop = $("messages").scrollHeight;
        $("chat-status").textContent = "streaming…";
      }
      if (choice && choice.finish_reason) $("chat-status").textContent = `finished: ${choice.finish_reason}`;
      if (chunk.usage) $("chat-status").textContent += ` · ${chunk.usage.prompt_tokens} prompt + ${chunk.usage.completion_tokens} new tokens`;
    });
  } catch (error) {
    $("chat-status").textContent = error.name === "AbortError" ? "stopped: the request was aborted and its blocks freed" : `error: ${error.message}`;
    answer.classList.add(error.name === "AbortError" ? "stopped" : "failed");
  } finally {
    answer.classList.remove("streaming");
    chat.messages.push({ role: "assistant", content: reply });
    chat.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function setUpChat() {
  for (const id of ["temperature", "top-p", "max-tokens"]) {
    const show = () => { $(`${id}-value`).textContent = $(id).value; };
    $(id).addEventListener("input", show);
    show();
  }
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || chat.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("clear").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.messages = [];
    $("messages").replaceChildren();
    $("chat-status").textContent = "";
  });
}

// ---- the live engine view ------------------------------------------------------------------------
const live = { last: null, steps: [], series: [], events: [], blocks: new Map(), fading: false };
const KEEP_STEPS = 106, KEEP_POINTS = 240, FADE_MS = 1500;

async function followLive() {
  for (;;) {
    try {
      const response = await request("/api/live");
      $("live-status").textContent = "live";
      await readEvents(response, (data) => onUpdate(JSON.parse(data)));
      $("live-status").textContent = "the server closed the stream; reconnecting…";
    } catch (error) {
      $("live-status").textContent = `disconnected (${error.message}); reconnecting…`;
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function onUpdate(update) {
  live.last = update;
  window.minillmLive = update;          // for the curious, in the browser's console
  live.steps.push(...update.steps);
  live.steps.splice(0, Math.max(0, live.steps.length - KEEP_STEPS));
  const itl = update.latency.itl_s;
  live.series.push({ t: update.t, tokens: update.stats.tokens_generated, ttft: update.latency.ttft_s,
                     itl: itl.length ? itl.reduce((a, b) => a + b, 0) / itl.length : null });
  live.series.splice(0, Math.max(0, live.series.length - KEEP_POINTS));
  for (const e of update.events) live.events.unshift(`t=${fmt(e.t)} s: request #${e.id} preempted (its blocks freed; recomputed when it is admitted again)`);
  for (const f of update.finished) {   // each finish comes in one update only
    live.events.unshift(`t=${fmt(f.t)} s: request #${f.id}${mine.has(f.id) ? " (you)" : ""} finished (${f.reason}): ` +
                        `${f.prompt_tokens} prompt + ${f.output_tokens} new tokens, TTFT ${fmt(f.ttft_s, 3)} s, ${fmt(f.duration_s, 2)} s in all`);
  }
  live.events.splice(30);
  renderCounters(update);
  renderRequests(update);
  renderBatches(update);
  renderPool(update);
  renderCharts();
  $("events").replaceChildren(...live.events.map((text) => el("li", { text })));
}

function tokensPerSecond() {
  const s = live.series;
  if (s.length < 2) return 0;
  const first = s.find((p) => p.t >= s[s.length - 1].t - 2) || s[0];
  const last = s[s.length - 1];
  return last.t > first.t ? (last.tokens - first.tokens) / (last.t - first.t) : 0;
}

function renderCounters(u) {
  const s = u.stats;
  const items = [["running", s.running], ["waiting", s.waiting], ["batch", s.batch_size], ["steps", s.steps],
                 ["tokens", s.tokens_generated], ["tok/s", fmt(tokensPerSecond())], ["preemptions", s.preemptions],
                 ["prefix-hit tokens", s.prefix_hit_tokens]];
  $("counters").replaceChildren(...items.map(([name, value]) =>
    el("div", { class: "counter", "data-name": name }, el("b", { text: String(value) }), el("span", { text: name }))));
}

function renderRequests(u) {
  const rows = u.requests.map((r) => {
    const tr = el("tr", { "data-request-id": String(r.id), "data-state": r.state, class: mine.has(r.id) ? "mine" : "" },
      el("td", {}, el("i", { class: "swatch" }), `#${r.id}${mine.has(r.id) ? " (you)" : ""}`),
      el("td", { text: r.state }), el("td", { text: String(r.prompt_tokens) }), el("td", { text: String(r.output_tokens) }),
      el("td", { text: String(r.blocks.length) }), el("td", { text: fmt(r.age_s) }), el("td", { text: fmt(r.ttft_s, 3) }));
    tr.querySelector(".swatch").style.background = colour(r.id);
    return tr;
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "7", class: "muted", text: "no request in the engine" })));
  $("requests").tBodies[0].replaceChildren(...rows);
}

function renderBatches(u) {
  const canvas = $("batches"), g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const steps = live.steps, width = 6, top = 4, height = canvas.height - top - 12;
  // A segment's height grows with log2(1 + tokens): a 500-token prefill chunk beside 1-token decode rows.
  const size = (tokens) => Math.log2(1 + tokens);
  const most = Math.max(4, ...steps.map((s) => s.rows.reduce((n, r) => n + size(r.tokens), 0)));
  steps.forEach((step, i) => {
    let y = top + height;
    for (const row of step.rows) {
      const h = Math.max(2, (size(row.tokens) / most) * height);
      g.fillStyle = colour(row.id, row.kind === "prefill" ? 80 : 50);
      g.fillRect(i * width, y - h, width - 1, h - 1);
      y -= h;
    }
  });
  g.fillStyle = "#666";
  g.font = "10px sans-serif";
  const widest = Math.max(0, ...steps.map((s) => s.rows.reduce((n, r) => n + r.tokens, 0)));
  g.fillText(`most tokens in a step: ${widest}`, canvas.width - 150, 10);
  const last = steps[steps.length - 1];
  if (last) {
    const prefill = last.rows.filter((r) => r.kind === "prefill").length;
    $("batch").textContent = `last step #${last.step}: ${last.rows.length} rows (${prefill} prefill, ${last.rows.length - prefill} decode)`;
    $("batch").dataset.rows = String(last.rows.length);
  }
}

function renderPool(u) {
  const now = performance.now();
  const owners = new Map();             // block -> the request ids holding it
  for (const r of u.requests) for (const b of r.blocks) owners.set(b, [...(owners.get(b) || []), r.id]);
  const cached = new Set(u.pool.cached), shared = new Set(u.pool.shared);
  for (const [block, state] of live.blocks) {
    if (!owners.has(block) && state.freedAt === undefined) state.freedAt = now;
  }
  for (const [block, ids] of owners) live.blocks.set(block, { id: ids[0] });
  live.pool = { total: u.pool.total, owners, cached, shared };
  drawPool();
  const held = new Map();
  for (const r of u.requests) if (r.blocks.length) held.set(r.id, r.blocks.length);
  $("pool-legend").replaceChildren(...[...held].map(([id, n]) => {
    const item = el("li", { "data-id": String(id), "data-blocks": String(n) }, el("i", { class: "swatch" }),
                    `#${id}${mine.has(id) ? " (you)" : ""}: ${n} block${n === 1 ? "" : "s"}`);
    item.querySelector(".swatch").style.background = colour(id);
    return item;
  }));
  const s = u.stats;
  $("pool-summary").textContent = `${s.blocks_used} used · ${s.blocks_cached} cached · ${s.blocks_free} free of ${s.blocks_total} ` +
                                  `(${u.pool.block_size} tokens a block), ${u.pool.shared.length} shared`;
  $("pool-summary").dataset.used = String(s.blocks_used);
}

function drawPool() {
  const canvas = $("pool"), g = canvas.getContext("2d"), p = live.pool, now = performance.now();
  const cell = Math.max(2, Math.floor(Math.sqrt((canvas.width * 160) / p.total)));
  const cols = Math.floor(canvas.width / cell);
  const rows = Math.ceil(p.total / cols);
  if (canvas.height !== rows * cell) canvas.height = rows * cell;
  g.clearRect(0, 0, canvas.width, canvas.height);
  let fading = false;
  for (let b = 0; b < p.total; b++) {
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
    const ids = p.owners.get(b), state = live.blocks.get(b);
    g.globalAlpha = 1;
    if (ids) g.fillStyle = colour(ids[0]);
    else if (state && state.freedAt !== undefined && now - state.freedAt < FADE_MS) {
      g.fillStyle = colour(state.id);
      g.globalAlpha = 1 - (now - state.freedAt) / FADE_MS;
      fading = true;
    } else if (p.cached.has(b)) g.fillStyle = "#bbb";
    else g.fillStyle = "#eee";
    g.fillRect(x, y, cell - 1, cell - 1);
    if (p.shared.has(b) && cell >= 4) {
      g.globalAlpha = 1;
      g.strokeStyle = "#000";
      g.strokeRect(x + 0.5, y + 0.5, cell - 2, cell - 2);
    }
  }
  g.globalAlpha = 1;
  for (const [b, state] of live.blocks) if (state.freedAt !== undefined && now - state.freedAt >= FADE_MS) live.blocks.delete(b);
  if (fading && !live.fading) {
    live.fading = true;
    requestAnimationFrame(() => { live.fading = false; drawPool(); });
  }
}

function renderCharts() {
  const canvas = $("charts"), g = canvas.getContext("2d"), s = live.series;
  g.clearRect(0, 0, canvas.width, canvas.height);
  if (s.length < 2) return;
  const panels = [
    { title: "TTFT s (each request)", points: s.flatMap((p) => p.ttft.map((v) => [p.t, v])), dots: true },
    { title: "inter-token latency s (mean)", points: s.filter((p) => p.itl !== null).map((p) => [p.t, p.itl]) },
    { title: "tokens/s", points: s.slice(1).map((p, i) => [p.t, (p.tokens - s[i].tokens) / Math.max(1e-6, p.t - s[i].t)]) },
  ];
  const w = canvas.width / panels.length, h = canvas.height, t0 = s[0].t, t1 = s[s.length - 1].t;
  panels.forEach((panel, i) => {
    const x0 = i * w + 8, width = w - 16, y0 = 16, height = h - 30;
    const most = Math.max(1e-9, ...panel.points.map((p) => p[1]));
    g.strokeStyle = "#ccc";
    g.strokeRect(x0, y0, width, height);
    g.fillStyle = "#333";
    g.font = "11px sans-serif";
    g.fillText(panel.title, x0, 11);
    g.fillStyle = "#666";
    g.fillText(`max ${fmt(most, most < 1 ? 3 : 0)}`, x0 + 2, y0 + 11);
    g.fillText(`${fmt(t1 - t0, 0)} s`, x0 + width - 24, h - 3);
    const X = (t) => x0 + ((t - t0) / Math.max(1e-9, t1 - t0)) * width, Y = (v) => y0 + height - (v / most) * height;
    g.strokeStyle = g.fillStyle = "hsl(210, 70%, 45%)";
    g.beginPath();
    panel.points.forEach(([t, v], j) => {
      if (panel.dots) g.fillRect(X(t) - 2, Y(v) - 2, 4, 4);
      else if (j === 0) g.moveTo(X(t), Y(v));
      else g.lineTo(X(t), Y(v));
    });
    if (!panel.dots) g.stroke();
  });
}

async function main() {
  setUpChat();
  followLive();
  try {
    Object.assign(info, await getJSON("/api/info"));
    $("model-name").textContent = `· ${info.model} · ${info.context.toLocaleString("en-US")} tokens of context · ${info.blocks} KV blocks of ${info.block_size}`;
    $("max-tokens").max = String(info.context);
  } catch (error) {
    $("chat-status").textContent = `error: ${error.message}`;
  }
}

main();
