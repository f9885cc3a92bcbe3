// The live view of the KV cache: polls /v1/cache/summary a few times a second (bounded in size by
// the server however large the tree is) and draws blocks per tier, hit rate over time, requests and
// the top levels of the radix tree. Read-only; all text is set as textContent.
"use strict";

const POLL_MS = 250;
const HISTORY_S = 60;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const samples = []; // {t, queried, hit, inUse, total}
let promptedForKey = false;

function pct(part, whole) {
  return whole > 0 ? (100 * part) / whole : 0;
}

function rateText(hit, queried) {
  return queried > 0 ? pct(hit, queried).toFixed(1) + " %" : "–";
}

// hit rate over the samples of the last `seconds` before sample i
function windowRate(i, seconds) {
  const s = samples[i];
  let j = i;
  while (j > 0 && s.t - samples[j - 1].t <= seconds) j--;
  const q = s.queried - samples[j].queried;
  return q > 0 ? (s.hit - samples[j].hit) / q : null;
}

function bar(label, segments, total, note) {
  const row = el("div", { class: "tier" });
  row.append(el("div", { class: "tier-label" }, label));
  const track = el("div", { class: "bar", role: "img", "aria-label": label + ": " + note });
  for (const [cls, n] of segments) {
    const seg = el("span", { class: cls });
    seg.style.width = pct(n, total) + "%";
    track.append(seg);
  }
  row.append(track, el("div", { class: "tier-note" }, note));
  return row;
}

function drawTiers(s) {
  const rows = [];
  const d = s.tiers.device;
  rows.push(bar("Device", [["in-use", d.in_use], ["cached", d.evictable], ["free", d.free]], d.total,
    `${d.in_use} in use · ${d.cached} cached (${d.evictable} reclaimable) · ${d.free} free of ${d.total} blocks of ${s.block_size} tokens`));
  if (s.tiers.host) {
    const h = s.tiers.host;
    rows.push(bar("Host memory", [["cached", h.used], ["free", h.total - h.used]], h.total,
      `${h.used} of ${h.total} slots hold a block · ${h.stored} stored, ${h.loaded} loaded back`));
  }
  if (s.tiers.disk) {
    const k = s.tiers.disk;
    rows.push(bar("Disk", [["cached", k.used], ["free", k.total - k.used]], k.total,
      `${k.used} of ${k.total} blocks on disk`));
  }
  $("tiers").replaceChildren(...rows);
}

function drawHistory() {
  const w = 600, h = 120;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "prefix hit rate and device blocks in use over the last minute");
  const now = samples.length ? samples[samples.length - 1].t : 0;
  const x = (t) => w - ((now - t) / HISTORY_S) * w;
  const hits = [], used = [];
  const peak = Math.max(1, ...samples.map((s) => s.inUse)); // in-use is drawn against the window's peak
  $("history-peak").textContent = String(peak);
  for (let i = 0; i < samples.length; i++) {
    const r = windowRate(i, 5);
    if (r !== null) hits.push(`${x(samples[i].t).toFixed(1)},${(h - r * h).toFixed(1)}`);
    used.push(`${x(samples[i].t).toFixed(1)},${(h - (samples[i].inUse / peak) * h * 0.95).toFixed(1)}`);
  }
  for (const [cls, pts] of [["line-in-use", used], ["line-hit", hits]]) {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", cls);
    line.setAttribute("points", pts.join(" "));
    svg.append(line);
  }
  $("history").replaceChildren(svg);
}

function treeNode(node, scale) {
  const li = el("li");
  const row = el("div", { class: "node" });
  const fill = el("span", { class: "node-bar" + (node.num_requests > 0 ? " held" : "") });
  fill.style.width = Math.max(1, 0.4 * pct(node.num_tokens, scale)) + "%"; // the longest run: 40 %
  row.append(fill);
  const parts = [`${node.num_tokens} tokens`, `${node.num_blocks} block${node.num_blocks === 1 ? "" : "s"}`,
                 `${node.num_requests} request${node.num_requests === 1 ? "" : "s"}`, `age ${node.age}`];
  row.append(el("span", { class: "node-label" }, parts.join(" · ")));
  if (node.text !== undefined) row.append(el("q", { class: "node-text", title: node.text }, node.text.replace(/\n/g, "↵ ")));
  li.append(row);
  const more = node.num_children - node.children.length;
  if (node.children.length || more > 0) {
    const ul = el("ul");
    for (const c of node.children) ul.append(treeNode(c, scale));
    if (more > 0) ul.append(el("li", { class: "more" }, `… ${more} more`));
    li.append(ul);
  }
  return li;
}

function drawTree(s) {
  const t = s.tree;
  const root = t.root;
  let scale = 1; // the longest shown run, at any depth
  const stack = [...root.children];
  while (stack.length) {
    const n = stack.pop();
    scale = Math.max(scale, n.num_tokens);
    stack.push(...n.children);
  }
  const ul = el("ul", { class: "tree" });
  for (const c of root.children) ul.append(treeNode(c, scale));
  const more = root.num_children - root.children.length;
  if (more > 0) ul.append(el("li", { class: "more" }, `… ${more} more`));
  $("tree").replaceChildren(ul);
  let note = `${t.num_nodes} nodes holding ${t.num_cached_blocks} blocks; ${t.num_shown_nodes} shown. `
    + "Age counts cache lookups since a run was last used; a bar's width is its run's length.";
  if (!s.text_shown) note += " Text is hidden (start the server with --cache-view-text to show it).";
  $("tree-note").textContent = t.num_nodes ? note : "The tree is empty: nothing is cached yet.";
}

function draw(s) {
  const d = s.tiers.device;
  $("model-name").textContent = s.model;
  $("stat-running").textContent = s.requests.running;
  $("stat-waiting").textContent = s.requests.waiting;
  $("stat-in-use").textContent = d.in_use;
  $("stat-cached").textContent = d.cached;
  $("stat-free").textContent = d.free;
  $("stat-preemptions").textContent = s.num_preemptions;
  $("stat-hit-total").textContent = rateText(s.prefix_cache.hit_tokens, s.prefix_cache.queried_tokens);
  const r = windowRate(samples.length - 1, 10);
  $("stat-hit-recent").textContent = r === null ? "–" : (100 * r).toFixed(1) + " %";
  drawTiers(s);
  drawHistory();
  drawTree(s);
}

// the live region changes only when the state does (a screen reader announces each change)
function status(text) {
  if ($("status").textContent !== text) $("status").textContent = text;
}

async function poll() {
  try {
    const resp = await api("/v1/cache/summary?max_nodes=64", {}, !promptedForKey);
    if (resp.status === 401) promptedForKey = true; // asked once; the "API key…" button asks again
    if (!resp.ok) {
      status("The server answered: " + (await errorMessage(resp)));
    } else {
      promptedForKey = false;
      const s = await resp.json();
      const d = s.tiers.device;
      samples.push({ t: s.time, queried: s.prefix_cache.queried_tokens, hit: s.prefix_cache.hit_tokens,
                     inUse: d.in_use, total: d.total });
      while (samples.length && s.time - samples[0].t > HISTORY_S) samples.shift();
      status("Live");
      $("updated").textContent = "· updated " + new Date(s.time * 1000).toLocaleTimeString();
      draw(s);
    }
  } catch (e) {
    status("Cannot reach the server: " + (e.message || e));
  }
  setTimeout(poll, document.hidden ? 4 * POLL_MS : POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  setupKeyDialog();
  $("set-key").addEventListener("click", async () => {
    if (await askForKey("Enter the server's API key (kept in this browser only).")) promptedForKey = false;
  });
  poll();
});
