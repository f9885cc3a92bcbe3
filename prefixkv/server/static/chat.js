// The chat page: conversations kept in localStorage (one key each, so tabs never overwrite each
// other's chats), answers streamed from /v1/chat/completions (SSE), a stop button that aborts the
// request (the server aborts it when the connection closes), and per-answer figures from the
// stream's usage chunk. Model text is rendered as markdown with raw HTML escaped, then sanitised by
// DOMPurify; user text is only ever set as textContent.
"use strict";

const CONV_PREFIX = "prefixkv.conv.";
const CURRENT = "prefixkv.current";
const SETTINGS = "prefixkv.settings";
const SAVE_EVERY_MS = 1000; // a streaming answer is saved this often (a reload keeps what came)

const $ = (id) => document.getElementById(id);
let conversations = []; // newest first
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

function status(text) {
  $("status").textContent = text;
}

// ---------------------------------------------------------------- storage
function validConversation(c) {
  return c && typeof c.id === "string" && Array.isArray(c.messages)
    && c.messages.every((m) => m && typeof m.role === "string" && typeof m.content === "string");
}

function readConversations() {
  const out = [];
  for (let i = 0; i < localStorage.length; i++) {
    const key = localStorage.key(i);
    if (!key.startsWith(CONV_PREFIX)) continue;
    try {
      const c = JSON.parse(localStorage.getItem(key));
      if (validConversation(c)) out.push(c);
    } catch (e) { /* a corrupt entry is skipped */ }
  }
  for (const c of out) {
    for (const m of c.messages) {
      if (m.streaming && !(active && active.answer.id === m.id)) { // its page closed while it streamed
        delete m.streaming;
        m.stopped = true;
      }
    }
  }
  return out.sort((a, b) => (b.updated || 0) - (a.updated || 0));
}

function saveConversation(conv) {
  conv.saved = true; // from now on, a storage event without it means another tab deleted it
  try {
    localStorage.setItem(CONV_PREFIX + conv.id, JSON.stringify(conv));
    localStorage.setItem(CURRENT, currentId);
  } catch (e) {
    status("Could not save the conversation in this browser: " + (e.message || e));
  }
}

function load() {
  conversations = readConversations();
  currentId = localStorage.getItem(CURRENT);
  if (!conversations.some((c) => c.id === currentId)) {
    if (!conversations.length) conversations.push(makeConversation());
    currentId = conversations[0].id;
  }
  let s = {};
  try {
    s = JSON.parse(localStorage.getItem(SETTINGS) || "{}") || {};
  } catch (e) { /* defaults */ }
  for (const [id, key] of [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"], ["seed", "seed"]]) {
    if (typeof s[key] === "string") $(id).value = s[key];
  }
}

// another tab changed a conversation: take its version (but never under an answer streaming here)
function onStorage(ev) {
  if (ev.key !== null && !ev.key.startsWith(CONV_PREFIX)) return;
  const fresh = readConversations();
  // chats of this tab never saved yet (a new, empty one) are this tab's alone: kept
  for (const c of conversations) {
    if (!c.saved && !fresh.some((f) => f.id === c.id)) fresh.push(c);
  }
  if (active) {
    const i = fresh.findIndex((c) => c.id === active.conv.id);
    if (i >= 0) fresh[i] = active.conv;
    else fresh.unshift(active.conv);
  }
  const before = JSON.stringify(current() || null);
  conversations = fresh.length ? fresh : [makeConversation()];
  if (!conversations.some((c) => c.id === currentId)) currentId = conversations[0].id;
  renderConversations();
  if (JSON.stringify(current()) !== before && !(active && active.conv.id === currentId)) renderMessages();
}

function saveSettings() {
  try {
    localStorage.setItem(SETTINGS, JSON.stringify({
      temperature: $("temperature").value, top_p: $("top-p").value,
      max_tokens: $("max-tokens").value, seed: $("seed").value,
    }));
  } catch (e) { /* settings are a convenience */ }
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
  const parts = [(st.approx ? "~" : "") + st.tokens + " tokens"];
  if (st.ttft !== null) parts.push("TTFT " + st.ttft.toFixed(2) + " s");
  if (st.tps !== null) parts.push(st.tps.toFixed(1) + " tok/s");
  if (st.cached !== null) parts.push(st.cached + " cached");
  return parts.join(" · ");
}

function messageNode(msg) {
  const node = el("div", { class: "msg " + msg.role, "data-id": msg.id || "" });
  node.append(el("div", { class: "role" }, msg.role === "user" ? "You" : "Assistant"));
  node.append(el("div", { class: "content" }), el("div", { class: "stats" }));
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
  node.setAttribute("aria-busy", msg.streaming ? "true" : "false"); // announced once, when complete
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
  const stopHadFocus = document.activeElement === $("stop");
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  status(busy ? "Generating…" : "");
  if (!busy && stopHadFocus) $("input").focus(); // a disabled button keeps no focus
}

// ---------------------------------------------------------------- conversations
function switchTo(id) {
  currentId = id;
  try {
    localStorage.setItem(CURRENT, currentId);
  } catch (e) { /* not fatal */ }
  renderConversations();
  renderMessages();
  closeSidebar();
  $("input").focus();
}

function remove(id) {
  if (active && active.conv.id === id) stop();
  conversations = conversations.filter((c) => c.id !== id);
  localStorage.removeItem(CONV_PREFIX + id);
  if (!conversations.length) conversations.push(makeConversation());
  if (currentId === id) currentId = conversations[0].id;
  renderConversations();
  renderMessages();
  $("input").focus(); // the focused button is gone
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
    if (m.role === "assistant" && (m.error || !m.content)) {
      // a turn that produced nothing is left out whole: roles keep alternating
      if (messages.length && messages[messages.length - 1].role === "user") messages.pop();
      continue;
    }
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
  conversations = [conv, ...conversations.filter((c) => c !== conv)];
  $("input").value = "";
  active = { controller: new AbortController(), conv, answer };
  saveConversation(conv);
  renderConversations();
  renderMessages();
  setBusy(true);
  try {
    await streamAnswer(body, conv, answer, active.controller.signal);
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else answer.error = String(e.message || e);
  } finally {
    delete answer.streaming;
    active = null;
    setBusy(false);
    refreshMessage(answer);
    if (conversations.includes(conv)) saveConversation(conv); // not if it was deleted meanwhile
  }
}

async function streamAnswer(body, conv, answer, signal) {
  let tFirst = null;
  let counted = 0;
  let usage = null;
  let savedAt = performance.now();
  const resp = await api("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  const t0 = resp.sentAt; // when the request that was answered left (after any key prompt)
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
    requestAnimationFrame(() => {
      pending = false;
      refreshMessage(answer);
      if (performance.now() - savedAt > SAVE_EVERY_MS && conversations.includes(conv)) {
        savedAt = performance.now();
        saveConversation(conv);
      }
    });
  };
  const finish = () => {
    const tEnd = performance.now();
    const tokens = usage ? usage.completion_tokens : counted;
    const details = usage && usage.prompt_tokens_details;
    answer.stats = {
      tokens,
      approx: !usage, // no usage chunk (stopped): content chunks counted, about one token each
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
    status("Cannot list models: " + (await errorMessage(resp)));
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
  window.addEventListener("storage", onStorage);
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key !== "Escape" || $("key-dialog").open) return;
    if ($("sidebar").classList.contains("open")) {
      closeSidebar();
      $("toggle-sidebar").focus();
    } else if (active) {
      ev.preventDefault();
      stop();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("set-key").addEventListener("click", () => askForKey("Enter the server's API key (kept in this browser only)."));
  $("system-prompt").addEventListener("input", () => {
    const conv = current();
    conv.system = $("system-prompt").value;
    saveConversation(conv);
  });
  for (const id of ["temperature", "top-p", "max-tokens", "seed"]) $(id).addEventListener("change", saveSettings);
  $("toggle-sidebar").addEventListener("click", () => {
    const open = $("sidebar").classList.toggle("open");
    $("toggle-sidebar").setAttribute("aria-expanded", String(open));
    if (open) $("new-chat").focus();
  });
  loadModel();
  $("input").focus();
}

document.addEventListener("DOMContentLoaded", main);
