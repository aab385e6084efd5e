// What both pages share: the API key (asked for once, kept in this browser), JSON and SSE over fetch.
// EventSource cannot send an Authorization header, so streams are read with fetch and parsed here.
"use strict";

const KEY_NAME = "minillm-api-key";

export function apiKey() {
  return localStorage.getItem(KEY_NAME) || "";
}

export function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The server said 401: show the key form once, resolve when the user has given a key.
let asking = null;
export function askForKey(message) {
  if (asking) return asking;
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message || "This server needs its API key.";
  form.hidden = false;
  input.focus();
  asking = new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_NAME, input.value.trim());
      form.hidden = true;
      asking = null;
      resolve();
    };
  });
  return asking;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// fetch, asking for the key and retrying when the server refuses it; other errors throw their message.
export async function request(url, options = {}) {
  for (;;) {
    const response = await fetch(url, { ...options, headers: headers(options.headers || {}) });
    if (response.status === 401) {
      await askForKey(await errorText(response));
      continue;
    }
    if (!response.ok) throw new Error(await errorText(response));
    return response;
  }
}

export async function getJSON(url) {
  return (await request(url)).json();
}

// Read a text/event-stream response, calling onData(data) for each event's data (a string).
export async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) onData(data.join("\n"));
    }
  }
}

// A request's colour, the same on every page and in every chart: spread around the hue circle.
export function colour(id, lightness = 55) {
  return `hsl(${(id * 137.508) % 360}, 65%, ${lightness}%)`;
}

export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

export function fmt(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
