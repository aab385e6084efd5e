// The page at /plan: the capacity planner's sliders; every change asks /api/plan, the CLI's own code.
"use strict";
import { el, fmt, getJSON } from "./common.js";

const $ = (id) => document.getElementById(id);
const FIELDS = ["model", "gpu", "weight_dtype", "kv_dtype", "context", "users", "latency_ms"];
const SVG = "http://www.w3.org/2000/svg";
let options = null, pending = 0;

function query() {
  const q = {};
  for (const name of FIELDS) q[name] = $(name).value;
  q.context = String(2 ** Number($("context").value));
  return q;
}

function showSliders() {
  $("context-value").textContent = (2 ** Number($("context").value)).toLocaleString("en-US");
  $("users-value").textContent = $("users").value;
  $("latency_ms-value").textContent = $("latency_ms").value;
  const q = query();
  $("cli-line").textContent = `minillm plan -m ${q.model} --gpu ${q.gpu} --dtype ${q.weight_dtype} --kv-dtype ${q.kv_dtype} ` +
                              `--context ${q.context} --users ${q.users}; ... --latency-ms ${q.latency_ms} --min-batch ${q.users}`;
}

async function update() {
  showSliders();
  const asked = ++pending;
  let plan;
  try {
    plan = await getJSON(`/api/plan?${new URLSearchParams(query())}`);
  } catch (error) {
    $("fits").textContent = `error: ${error.message}`;
    return;
  }
  if (asked !== pending) return;        // a later slider move is on its way: show that one
  render(plan);
}

function number(name, value, text, unit = "") {
  return [el("dt", { text: name }), el("dd", { "data-name": name, "data-value": String(value) }, text + unit)];
}

function render(p) {
  document.body.dataset.planned = JSON.stringify(query());
  $("fits").textContent = p.fits ? `${p.users} users at ${p.context.toLocaleString("en-US")} tokens fit (at most ${p.max_users})` : "does not fit";
  drawMemory(p.memory_gb);
  const d = p.decode;
  $("numbers").replaceChildren(
    ...number("weights", p.memory_gb.weights, fmt(p.memory_gb.weights, 2), " GB"),
    ...number("KV cache", p.memory_gb.kv, fmt(p.memory_gb.kv, 2), ` GB (${p.kv_bytes_per_token.toLocaleString("en-US")} bytes a token)`),
    ...number("reserve", p.memory_gb.reserve, fmt(p.memory_gb.reserve, 2), " GB (activations, workspace)"),
    ...number("free", p.memory_gb.free, fmt(p.memory_gb.free, 2), " GB"),
    ...number("decode step", d.step_ms, fmt(d.step_ms, 2), ` ms, ${d.bound}-bound${d.meets_latency ? " (meets the target)" : " (misses the target)"}`),
    ...number("tok/s per user", d.tok_s_per_user, fmt(d.tok_s_per_user, 1)),
    ...number("tok/s total", d.tok_s_total, fmt(d.tok_s_total, 0)),
    ...number("cost", p.cost_per_million ?? "", p.cost_per_million === null ? "–" : `$${fmt(p.cost_per_million, 3)}`, " per 1M output tokens"),
  );
  $("notes").replaceChildren(...p.notes.map((text) => el("li", { text })));
  $("ranking").tBodies[0].replaceChildren(...p.ranking.map((r) => el("tr", { "data-gpu": r.gpu, class: r.batch ? "" : "muted" },
    el("td", { text: r.gpu }), el("td", { text: fmt(r.price_per_hour, 2) }),
    el("td", { text: r.batch ? String(r.batch) : "–" }), el("td", { text: r.step_ms ? fmt(r.step_ms, 1) : "–" }),
    el("td", { text: r.cost_per_million ? `$${fmt(r.cost_per_million, 3)}` : `no: ${r.reason}` }))));
  const gpu = options.gpus.find((g) => g.name === p.gpu);
  $("price-source").textContent = gpu ? `${gpu.name}: ${fmt(gpu.memory_gb, 0)} GB, ${fmt(gpu.bandwidth_tb_s, 2)} TB/s, ` +
    `${fmt(gpu.bf16_tflop_s, 0)} TFLOP/s bf16, $${fmt(gpu.price_per_hour, 2)}/h from ${gpu.price_source} ` +
    `(minillm plan --prices to use yours)` : "";
}

function drawMemory(m) {
  const svg = $("memory"), width = 640, parts = [["weights", m.weights, "hsl(30, 80%, 55%)"],
    ["KV cache", m.kv, "hsl(210, 70%, 55%)"], ["reserve", m.reserve, "#999"], ["free", Math.max(0, m.free), "#e6e6e6"]];
  const scale = width / Math.max(m.total, m.weights + m.kv + m.reserve);
  svg.replaceChildren();
  let x = 0;
  for (const [name, gb, fill] of parts) {
    const w = gb * scale;
    const rect = document.createElementNS(SVG, "rect");
    for (const [k, v] of Object.entries({ x, y: 0, width: Math.max(0, w), height: 32, fill })) rect.setAttribute(k, v);
    const title = document.createElementNS(SVG, "title");
    title.textContent = `${name}: ${fmt(gb, 2)} GB`;
    rect.append(title);
    svg.append(rect);
    if (w > 110) {
      const label = document.createElementNS(SVG, "text");
      for (const [k, v] of Object.entries({ x: x + 4, y: 48, "font-size": 11 })) label.setAttribute(k, v);
      label.textContent = `${name} ${fmt(gb, 1)} GB`;
      svg.append(label);
    }
    x += w;
  }
  if (m.free < 0) {
    const over = document.createElementNS(SVG, "line");
    for (const [k, v] of Object.entries({ x1: m.total * scale, x2: m.total * scale, y1: 0, y2: 36, stroke: "red", "stroke-width": 2 })) over.setAttribute(k, v);
    svg.append(over);
  }
}

async function main() {
  options = await getJSON("/api/plan/options");
  const fill = (id, values, chosen) => {
    $(id).replaceChildren(...values.map((v) => el("option", { value: v, text: v })));
    $(id).value = chosen;
  };
  const d = options.defaults;
  fill("model", options.models, d.model);
  fill("gpu", options.gpus.map((g) => g.name), d.gpu);
  fill("weight_dtype", options.weight_dtypes, d.weight_dtype);
  fill("kv_dtype", options.kv_dtypes, d.kv_dtype);
  $("context").value = String(Math.round(Math.log2(d.context)));
  $("users").value = String(d.users);
  $("latency_ms").value = String(d.latency_ms);
  for (const name of FIELDS) $(name).addEventListener("input", update);
  await update();
}

main();
