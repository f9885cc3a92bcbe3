// Shared by the chat page and the cache view: the API key (kept in localStorage, sent only in the
// Authorization header, never in a URL) and a fetch wrapper that asks for the key on a 401.
"use strict";

const KEY_STORAGE = "prefixkv.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

// Opens the page's <dialog id="key-dialog">; resolves to true if a key was saved.
function askForKey(reason) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  const why = document.getElementById("key-reason");
  why.textContent = reason || "This server requires an API key.";
  input.value = apiKey();
  return new Promise((resolve) => {
    const done = (saved) => {
      dialog.removeEventListener("close", onClose);
      resolve(saved);
    };
    const onClose = () => {
      if (dialog.returnValue === "save" && input.value.trim()) {
        localStorage.setItem(KEY_STORAGE, input.value.trim());
        done(true);
      } else {
        done(false);
      }
    };
    dialog.addEventListener("close", onClose);
    dialog.returnValue = "";
    dialog.showModal();
    input.focus();
  });
}

// The API-key dialog both pages share, built here (ids key-dialog, key-form, key-reason, key-input,
// key-save, key-cancel) and appended to the page.
function buildKeyDialog() {
  const dialog = el("dialog", { id: "key-dialog", "aria-labelledby": "key-title" });
  const form = el("form", { id: "key-form" });
  const label = el("label", {}, "Key ");
  label.append(el("input", { id: "key-input", type: "password", autocomplete: "off" }));
  const buttons = el("div", { class: "buttons" });
  buttons.append(el("button", { id: "key-save", type: "submit" }, "Save"),
                 el("button", { id: "key-cancel", type: "button" }, "Cancel"));
  form.append(el("h2", { id: "key-title" }, "API key"), el("p", { id: "key-reason" }), label, buttons);
  dialog.append(form);
  document.body.append(dialog);
  return dialog;
}

function setupKeyDialog() {
  const dialog = buildKeyDialog();
  document.getElementById("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault(); // the key never leaves the page as a form submission (or in a URL)
    dialog.close("save");
  });
  document.getElementById("key-cancel").addEventListener("click", () => dialog.close("cancel"));
}

// fetch() with the key; on 401 asks for a key (unless prompt is false) and retries once.
async function api(path, options = {}, prompt = true) {
  for (let attempt = 0; ; attempt++) {
    const headers = Object.assign({}, options.headers || {});
    const key = apiKey();
    if (key) headers["Authorization"] = "Bearer " + key;
    const sentAt = performance.now();
    const resp = await fetch(path, Object.assign({}, options, { headers }));
    resp.sentAt = sentAt; // when the request that got this answer left
    if (resp.status !== 401 || attempt > 0 || !prompt) return resp;
    const saved = await askForKey(key ? "The API key was refused; enter another." : "This server requires an API key.");
    if (!saved) return resp;
  }
}

// The message of an OpenAI-style error body (or of the HTTP status).
async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + resp.status;
}

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  if (text !== undefined) node.textContent = text;
  return node;
}
