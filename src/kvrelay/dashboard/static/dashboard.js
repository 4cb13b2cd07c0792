// kvrelay's status page: polls /dashboard/api/state every POLL_MS and renders it; a request picked in the list (or named by #request=ID) shows its timeline and explanation.
"use strict";

const POLL_MS = 1500;
let selected = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const dash = "\u2014";
const pct = (x) => (x === null || x === undefined ? dash : (100 * x).toFixed(1) + "%");
const ms = (x) => (x === null || x === undefined ? dash : x < 10 ? x.toFixed(2) + " ms" : x.toFixed(1) + " ms");
const count = (n) => (n === null || n === undefined ? dash : Number(n).toLocaleString("en-US"));

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function byTier(table, format) {
  const parts = Object.entries(table || {}).filter(([, v]) => v).map(([tier, v]) => tier + " " + format(v));
  return parts.length ? parts.join(", ") : dash;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

function renderSummary(state) {
  const h = state.hits;
  setText("policy", "policy " + state.policy);
  setText("hit-share", pct(h.hit_share));
  setText("hit-detail", `${count(h.cached_tokens)} of ${count(h.prompt_tokens)} prompt tokens from cache, ${count(h.requests)} requests`);
  setText("bound-share", pct(h.bound_share));
  setText("bound-detail", `${count(h.bound_tokens)} tokens seen before anywhere; routing captured ${pct(h.captured_of_bound)} of them`);
  const t = state.ttft;
  setText("ttft-window", `last ${Math.round(t.window_s / 60)} min`);
  setText("ttft-p50", "p50 " + ms(t.p50_ms));
  setText("ttft-detail", `p90 ${ms(t.p90_ms)} · p99 ${ms(t.p99_ms)} · max ${ms(t.max_ms)} · ${count(t.count)} requests`);
  setText("in-flight", `${state.in_flight} in flight`);
}

function renderReuse(reuse) {
  if (!reuse) {
    setText("reuse-figures", dash);
    setText("reuse-ratios", "not reported by this router");
    return;
  }
  const a = reuse.available_tokens, c = reuse.captured_tokens, d = reuse.delivered_tokens;
  setText("reuse-figures", `${count(a)} → ${count(c)} → ${count(d)}`);
  setText("reuse-ratios", `tokens; captured ${pct(a ? c / a : null)} and delivered ${pct(a ? d / a : null)} of available`);
}

function renderWorkers(workers) {
  const body = document.querySelector("#workers tbody");
  const ids = Object.keys(workers);
  setText("worker-count", `${ids.length} live`);
  body.replaceChildren(...ids.map((id) => {
    const w = workers[id];
    const total = w.pages_total || 1;
    const used = Math.max(0, w.pages_used - w.pages_evictable);
    const age = w.heartbeat_age_s;
    return el("tr", { "data-worker-id": id },
      el("td", {}, el("strong", {}, id), el("div", { class: "muted" }, w.models.join(", "))),
      el("td", {}, w.epoch),
      el("td", {},
        `${count(w.pages_used)} / ${count(w.pages_free)} / ${count(w.pages_evictable)} of ${count(w.pages_total)}`,
        el("div", { class: "bar", title: "used (evictable lighter)" },
          el("span", { class: "used", style: `width:${(100 * used) / total}%` }),
          el("span", { class: "evictable", style: `width:${(100 * w.pages_evictable) / total}%` }))),
      el("td", {}, ms(1000 * w.queue_delay_s), el("div", { class: "muted" }, `${w.requests_routed} routed here`)),
      el("td", {}, `${w.active_lanes} / ${w.max_lanes}`),
      el("td", {}, byTier(w.bytes_by_tier, bytes)),
      el("td", {}, byTier(w.restore_bytes_per_s, (v) => bytes(v) + "/s")),
      el("td", { class: age !== null && age > 3 ? "end bad" : "" }, age === null ? dash : age.toFixed(1) + " s ago"));
  }));
}

function endText(r) {
  if (r.finish_reason === null) return el("span", { class: "end running" }, "running");
  const bad = r.finish_reason === "error" || r.finish_reason === "cancelled";
  return el("span", { class: "end " + (bad ? "bad" : "ok") }, r.finish_reason + (r.error ? ": " + r.error : ""));
}

function candidateList(decision) {
  const items = decision.candidates.map((c) =>
    el("li", { class: c.winner ? "winner" : "", "data-worker-id": c.worker_id },
      c.winner ? "★ " : "· ",
      el("strong", {}, c.worker_id), ` [${c.route}] cached ${count(c.cached_tokens)}, predicted ${ms(c.predicted_ttft_ms)}`,
      c.winner ? el("span", { class: "why" }, " — winner") : null,
      c.lost_because ? el("span", { class: "why" }, " — lost: " + c.lost_because) : null));
  const excluded = Object.entries(decision.excluded).map(([wid, why]) => el("li", { class: "excluded" }, `excluded ${wid}: ${why}`));
  return el("ul", { class: "candidates" }, items, excluded,
    el("li", { class: "why" }, `attempt ${decision.attempt}, policy ${decision.policy}; offer: ${decision.offer}`));
}

function renderRequests(requests) {
  const box = document.getElementById("requests");
  if (!requests.length) {
    box.replaceChildren(el("p", { class: "muted" }, "No request yet: send one to /v1/completions."));
    return;
  }
  box.replaceChildren(...requests.map((r) => {
    const last = r.decisions[r.decisions.length - 1];
    const when = new Date(r.arrived * 1000).toLocaleTimeString("en-GB");
    return el("article", {
        class: "request" + (r.request_id === selected ? " selected" : ""),
        "data-request-id": r.request_id,
        onclick: () => select(r.request_id),
      },
      el("div", { class: "head" },
        el("a", { class: "rid", href: "#request=" + encodeURIComponent(r.request_id) }, r.request_id),
        el("span", { class: "muted" }, when),
        el("span", {}, `${count(r.prompt_tokens)} prompt tokens (${count(r.bound_tokens)} seen before)`),
        el("span", {}, last ? `→ ${last.winner || "nobody"}` : "no decision yet"),
        el("span", {}, `cached ${count(r.cached_tokens)}`),
        el("span", {}, `TTFT ${ms(r.ttft_ms)}` + (last && last.predicted_ttft_ms !== null ? ` (predicted ${ms(last.predicted_ttft_ms)})` : "")),
        endText(r)),
      r.decisions.map(candidateList));
  }));
}

async function fetchJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) {
    const body = await response.json().catch(() => null);
    throw new Error(body && body.error ? body.error.message : `${url}: HTTP ${response.status}`);
  }
  return response.json();
}

async function renderDetail() {
  if (!selected) return;
  document.getElementById("detail-empty").hidden = true;
  const body = document.getElementById("detail-body");
  let detail;
  try {
    detail = await fetchJSON("/dashboard/api/requests/" + encodeURIComponent(selected));
  } catch (err) {
    body.hidden = true;
    const empty = document.getElementById("detail-empty");
    empty.hidden = false;
    empty.textContent = `Request ${selected}: ${err.message}`;
    return;
  }
  body.hidden = false;
  document.getElementById("detail-head").replaceChildren(
    el("div", {}, el("strong", { class: "rid", id: "detail-id" }, detail.request_id), " ", endText(detail)),
    el("div", { class: "muted" }, `${detail.model}, ${count(detail.prompt_tokens)} prompt tokens, ` +
      `${count(detail.generated_tokens)} generated, attempts ${detail.attempts === null ? dash : detail.attempts}`));
  if (detail.from_store) {
    document.querySelector("#timeline tbody").replaceChildren(el("tr", { "data-kind": "none" },
      el("td", { colspan: "4", class: "muted" },
        "This router no longer holds this request's timeline; its decisions and outcome below come from the fact store.")));
    setText("explain", detail.explain.join("\n"));
    return;
  }
  document.querySelector("#timeline tbody").replaceChildren(...detail.timeline.map((m) =>
    el("tr", { class: "k-" + m.kind, "data-kind": m.kind },
      el("td", {}, m.offset_ms.toFixed(1)),
      el("td", {}, m.attempt || ""),
      el("td", {}, m.kind.replace("_", " ")),
      el("td", {}, m.text))));
  setText("explain", detail.explain.join("\n"));
}

function select(requestId) {
  selected = requestId;
  if (location.hash !== "#request=" + encodeURIComponent(requestId)) history.replaceState(null, "", "#request=" + encodeURIComponent(requestId));
  document.querySelectorAll(".request").forEach((node) => node.classList.toggle("selected", node.dataset.requestId === requestId));
  renderDetail();
}

function fromHash() {
  const match = /^#request=(.+)$/.exec(location.hash);
  if (match) select(decodeURIComponent(match[1]));
}

async function poll() {
  const live = document.getElementById("live");
  try {
    const state = await fetchJSON("/dashboard/api/state");
    renderSummary(state);
    renderReuse(state.reuse);
    renderWorkers(state.workers);
    renderRequests(state.requests);
    await renderDetail();
    live.textContent = "live · " + new Date(state.now * 1000).toLocaleTimeString("en-GB");
    live.classList.remove("stale");
    document.body.dataset.updated = String(state.now);
  } catch (err) {
    live.textContent = "not updating: " + err.message;
    live.classList.add("stale");
  }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("hashchange", fromHash);
fromHash();
poll();
