// The chat page: conversations kept in localStorage, answers streamed from /v1/chat/completions (SSE),
// a stop button that aborts the request (the server aborts it when the connection closes), and
// per-answer figures from the stream's usage chunk. Model text is rendered as markdown with raw HTML
// escaped, then sanitised by DOMPurify; user text is only ever set as textContent.
"use strict";

const STORE = "prefixkv.conversations";
const CURRENT = "prefixkv.current";
const SETTINGS = "prefixkv.settings";

const $ = (id) => document.getElementById(id);
let conversations = [];
let currentId = null;
let modelName = null;
let active = null; // {controller, conv, answer} while a request streams

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function renderMarkdown(node, text) {
  node.innerHTML = DOMPurify.sanitize(marked.parse(text));
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function load() {
  try {
    conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
  } catch (e) {
    conversations = [];
  }
  if (!Array.isArray(conversations)) conversations = [];
  for (const conv of conversations) {
    for (const m of conv.messages) {
      if (m.streaming) { // the page was closed while it streamed
        delete m.streaming;
        m.stopped = true;
      }
    }
  }
  currentId = localStorage.getItem(CURRENT);
  if (!conversations.some((c) => c.id === currentId)) {
    if (!conversations.length) conversations.push(makeConversation());
    currentId = conversations[0].id;
  }
  const s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  for (const [id, key] of [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"], ["seed", "seed"]]) {
    if (s[key] !== undefined && s[key] !== null) $(id).value = s[key];
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  localStorage.setItem(CURRENT, currentId);
}

function saveSettings() {
  localStorage.setItem(SETTINGS, JSON.stringify({
    temperature: $("temperature").value, top_p: $("top-p").value,
    max_tokens: $("max-tokens").value, seed: $("seed").value,
  }));
}

function makeConversation() {
  return { id: newId(), title: "New chat", system: "", messages: [], updated: Date.now() };
}

function current() {
  return conversations.find((c) => c.id === currentId);
}

// ---------------------------------------------------------------- rendering
function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of conversations) {
    const li = el("li");
    const open = el("button", { type: "button", class: "conv" }, conv.title || "New chat");
    if (conv.id === currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => switchTo(conv.id));
    const del = el("button", { type: "button", class: "delete", "aria-label": "Delete " + (conv.title || "chat") }, "×");
    del.addEventListener("click", () => remove(conv.id));
    li.append(open, del);
    list.append(li);
  }
}

function statsText(st) {
  const parts = [st.tokens + " tokens"];
  if (st.ttft !== null) parts.push("TTFT " + st.ttft.toFixed(2) + " s");
  if (st.tps !== null) parts.push(st.tps.toFixed(1) + " tok/s");
  if (st.cached !== null) parts.push(st.cached + " cached");
  return parts.join(" · ");
}

function messageNode(msg) {
  const node = el("div", { class: "msg " + msg.role, "data-id": msg.id });
  node.append(el("div", { class: "role" }, msg.role === "user" ? "You" : "Assistant"));
  const body = el("div", { class: "content" });
  node.append(body, el("div", { class: "stats" }));
  fillMessage(node, msg);
  return node;
}

function fillMessage(node, msg) {
  const body = node.querySelector(".content");
  if (msg.role === "assistant") renderMarkdown(body, msg.content);
  else body.textContent = msg.content;
  const stats = node.querySelector(".stats");
  const notes = [];
  if (msg.stats) {
    notes.push(statsText(msg.stats));
    stats.dataset.tokens = msg.stats.tokens;
    if (msg.stats.cached !== null) stats.dataset.cached = msg.stats.cached;
  }
  if (msg.stopped) notes.push("stopped");
  if (msg.error) notes.push("error: " + msg.error);
  stats.textContent = notes.join(" · ");
  node.classList.toggle("error", !!msg.error);
  node.classList.toggle("streaming", !!msg.streaming);
}

function renderMessages() {
  const conv = current();
  const box = $("messages");
  box.replaceChildren(...conv.messages.map(messageNode));
  box.scrollTop = box.scrollHeight;
  $("system-prompt").value = conv.system || "";
}

function refreshMessage(msg) {
  const node = $("messages").querySelector('[data-id="' + msg.id + '"]');
  if (!node) return; // its conversation is not shown
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  fillMessage(node, msg);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("status").textContent = busy ? "Generating…" : "";
}

// ---------------------------------------------------------------- conversations
function switchTo(id) {
  currentId = id;
  save();
  renderConversations();
  renderMessages();
  closeSidebar();
  $("input").focus();
}

function remove(id) {
  if (active && active.conv.id === id) stop();
  conversations = conversations.filter((c) => c.id !== id);
  if (!conversations.length) conversations.push(makeConversation());
  if (currentId === id) currentId = conversations[0].id;
  save();
  renderConversations();
  renderMessages();
}

function newChat() {
  const conv = makeConversation();
  conversations.unshift(conv);
  switchTo(conv.id);
}

// ---------------------------------------------------------------- requests
function numberField(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const v = parse(raw);
  return Number.isFinite(v) ? v : undefined;
}

function requestBody(conv) {
  const messages = [];
  if (conv.system && conv.system.trim()) messages.push({ role: "system", content: conv.system });
  for (const m of conv.messages) {
    if (m.streaming) continue;
    if (m.role === "assistant" && (m.error || !m.content)) continue;
    messages.push({ role: m.role, content: m.content });
  }
  const body = { model: modelName, messages, stream: true, stream_options: { include_usage: true } };
  const fields = { temperature: ["temperature", parseFloat], top_p: ["top-p", parseFloat],
                   max_tokens: ["max-tokens", (s) => parseInt(s, 10)], seed: ["seed", (s) => parseInt(s, 10)] };
  for (const [name, [id, parse]] of Object.entries(fields)) {
    const v = numberField(id, parse);
    if (v !== undefined) body[name] = v;
  }
  return body;
}

async function send() {
  if (active) return;
  const text = $("input").value;
  if (!text.trim()) return;
  const conv = current();
  if (!conv.messages.length) conv.title = text.trim().slice(0, 48);
  conv.messages.push({ id: newId(), role: "user", content: text });
  const body = requestBody(conv);
  const answer = { id: newId(), role: "assistant", content: "", streaming: true };
  conv.messages.push(answer);
  conv.updated = Date.now();
  $("input").value = "";
  save();
  renderConversations();
  renderMessages();
  active = { controller: new AbortController(), conv, answer };
  setBusy(true);
  try {
    await streamAnswer(body, answer, active.controller.signal);
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else answer.error = String(e.message || e);
  } finally {
    delete answer.streaming;
    active = null;
    setBusy(false);
    refreshMessage(answer);
    save();
  }
}

async function streamAnswer(body, answer, signal) {
  const t0 = performance.now();
  let tFirst = null;
  let counted = 0;
  let usage = null;
  const resp = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  if (!resp.ok) {
    answer.error = await errorMessage(resp);
    return;
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; refreshMessage(answer); });
  };
  const finish = () => {
    const tEnd = performance.now();
    const tokens = usage ? usage.completion_tokens : counted;
    const details = usage && usage.prompt_tokens_details;
    answer.stats = {
      tokens,
      ttft: tFirst === null ? null : (tFirst - t0) / 1000,
      tps: tFirst !== null && tokens > 1 && tEnd > tFirst ? (tokens - 1) / ((tEnd - tFirst) / 1000) : null,
      cached: details ? details.cached_tokens : null,
      prompt: usage ? usage.prompt_tokens : null,
    };
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) {
            answer.error = chunk.error.message;
            continue;
          }
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              if (tFirst === null) tFirst = performance.now();
              answer.content += piece;
              counted += 1;
              redraw();
            }
          }
        }
      }
    }
  } finally {
    finish();
  }
}

function stop() {
  if (active) active.controller.abort();
}

// ---------------------------------------------------------------- layout
function closeSidebar() {
  $("sidebar").classList.remove("open");
  $("toggle-sidebar").setAttribute("aria-expanded", "false");
}

async function loadModel() {
  const resp = await api("/v1/models");
  if (!resp.ok) {
    $("status").textContent = "Cannot list models: " + (await errorMessage(resp));
    return;
  }
  const body = await resp.json();
  modelName = body.data.length ? body.data[0].id : null;
  $("model-name").textContent = modelName || "";
}

function main() {
  marked.use({ gfm: true, breaks: true, renderer: { html: ({ text }) => escapeHtml(text) } });
  setupKeyDialog();
  load();
  renderConversations();
  renderMessages();
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && active) {
      ev.preventDefault();
      stop();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("set-key").addEventListener("click", () => askForKey("Enter the server's API key (kept in this browser only)."));
  $("system-prompt").addEventListener("input", () => { current().system = $("system-prompt").value; save(); });
  for (const id of ["temperature", "top-p", "max-tokens", "seed"]) $(id).addEventListener("change", saveSettings);
  $("toggle-sidebar").addEventListener("click", () => {
    const open = $("sidebar").classList.toggle("open");
    $("toggle-sidebar").setAttribute("aria-expanded", String(open));
  });
  loadModel();
  $("input").focus();
}

document.addEventListener("DOMContentLoaded", main);
