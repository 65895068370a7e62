// The page of `orchestrator serve`: a chat over /v1/chat/completions (streamed) and the pipeline view over
// /pipeline/events. Plain JS on purpose: nothing to build, nothing loaded from the internet (docs/web.md).
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

// Reads a server-sent-event stream from a fetch response, calling onData with each event's data line.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) onData(line.slice(6));
    }
  }
}

function number(id) { return Number($(id).value); }

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  bubble("user", text);
  history.push({ role: "user", content: text });
  const messages = ($("system").value.trim() ? [{ role: "system", content: $("system").value.trim() }] : []).concat(history);
  const body = { messages, stream: true, temperature: number("temperature"), top_k: number("top_k"),
                 top_p: number("top_p"), min_p: number("min_p"), max_tokens: number("max_tokens"), seed: number("seed") };
  const out = bubble("assistant", "");
  controller = new AbortController();
  $("go").disabled = true; $("stop").disabled = false;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                          signal: controller.signal });
    if (!response.ok) throw new Error((await response.json()).error?.message || response.statusText);
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      const delta = JSON.parse(data).choices?.[0]?.delta || {};
      if (delta.content) { out.textContent += delta.content; $("messages").scrollTop = $("messages").scrollHeight; }
    });
  } catch (err) {
    if (err.name !== "AbortError") { out.className = "msg error"; out.textContent += "\n[" + err.message + "]"; }
  }
  history.push({ role: "assistant", content: out.textContent });
  out.dataset.done = "1";
  controller = null;
  $("go").disabled = false; $("stop").disabled = true;
}

function mib(n) { return n == null ? "" : n >= 10 * 1073741824 ? (n / 1073741824).toFixed(1) + " GiB" : (n / 1048576).toFixed(1) + " MiB"; }
function ms(s) { return s == null ? "" : (1000 * s).toFixed(s < 0.01 ? 2 : 1) + " ms"; }
function bytes(n) { return n == null ? "" : n < 10240 ? n.toFixed(0) + " B" : (n / 1024).toFixed(1) + " KiB"; }

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

function show(s) {
  $("model").textContent = s.model + (s.loaded ? "" : " (loading)");
  $("status").textContent = s.failed ? "failed: " + s.failed : s.loaded ? "" : "loading the model…";
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of s.workers) {
    const row = body.insertRow();
    row.className = "worker";
    cell(row, w.endpoint);
    cell(row, w.kind);
    cell(row, !w.layers ? "none" : (w.layers[1] > w.layers[0] ? w.layers[0] + "–" + (w.layers[1] - 1) : "") +
                      (w.output ? " + output" : ""), "layers");
    cell(row, mib(w.free));
    cell(row, mib(w.free_now), "free-now");
    if (w.total != null) row.cells[row.cells.length - 1].title = "of " + mib(w.total) + ", probed " + w.probe_age.toFixed(0) + " s ago";
    cell(row, mib(w.weight_bytes)); cell(row, mib(w.kv_bytes)); cell(row, mib(w.compute_bytes));
    cell(row, ms(w.rtt), "rtt");
    cell(row, w.state, "state-" + w.state);
  }
  $("links").replaceChildren(...s.links.map((l) => {
    const li = document.createElement("li");
    li.textContent = l.src + " → " + l.dst + ": set up to " + (l.push ? "push" : "relay" + (l.reason ? " (" + l.reason + ")" : ""));
    if (l.relayed != null) li.textContent += "; the last step " + (l.relayed ? "relayed it through the server" : "pushed it");
    if (l.bytes_per_token != null) li.textContent += ", " + bytes(l.bytes_per_token) + " per token from " + l.src;
    if (l.rtt_src != null && l.rtt_dst != null)
      li.textContent += "; round trip server ↔ " + l.src + " " + ms(l.rtt_src) + ", ↔ " + l.dst + " " + ms(l.rtt_dst);
    li.className = "link";
    return li;
  }));
  timeline(s);
  const m = s.metrics || {};
  const rows = {
    "active slots": s.processing + " / " + s.slots.length, "queue": s.queue,
    "prompt": (m.prompt_tokens || 0) + " tokens" + (m.prompt_seconds ? ", " + (m.prompt_tokens / m.prompt_seconds).toFixed(1) + " tok/s" : ""),
    "generated": (m.tokens_predicted || 0) + " tokens" + (m.tokens_predicted_seconds ? ", " + (m.tokens_predicted / m.tokens_predicted_seconds).toFixed(1) + " tok/s" : ""),
    "decodes": m.n_decode || 0,
    "re-plans": s.replans || 0,
  };
  if (s.throughput != null) rows["last steps"] = s.throughput.toFixed(1) + " tok/s through the pipeline (prompt and generated)";
  if (s.draft) rows["draft acceptance"] = s.draft.accepted + " / " + s.draft.drafted;
  $("engine").replaceChildren(...Object.entries(rows).flatMap(([k, v]) => {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = k; dd.textContent = v;
    return [dt, dd];
  }));
}

// The last steps, one bar each on a common scale: per stage its wait and its send → reply time, or the
// whole step where the server saw only that (pushed steps, the ring).
function timeline(s) {
  const steps = s.timeline || [];
  const longest = Math.max(1e-9, ...steps.map((t) => t.stages.reduce((a, st) => a + (st.wait || 0) + (st.busy || 0), 0) || t.seconds));
  $("timeline").replaceChildren(...steps.map((t) => {
    const row = document.createElement("div"), label = document.createElement("span"), track = document.createElement("div");
    row.className = "step"; track.className = "track";
    label.textContent = t.kind + ", " + t.n_tokens + " tok, " + ms(t.seconds);
    const segment = (cls, seconds, title) => {
      const seg = document.createElement("span");
      seg.className = "seg " + cls; seg.style.width = (100 * seconds / longest) + "%"; seg.title = title;
      track.appendChild(seg);
    };
    if (t.stages.every((st) => st.busy == null)) segment("whole", t.seconds, "whole step " + ms(t.seconds));
    else t.stages.forEach((st, i) => {
      segment("wait", st.wait || 0, st.endpoint + ": waited " + ms(st.wait));
      segment("busy" + (i % 2 ? " odd" : ""), st.busy || 0, st.endpoint + ": send → reply " + ms(st.busy) +
              ", " + bytes(st.sent) + " sent, " + bytes(st.received) + " received");
    });
    row.append(label, track);
    return row;
  }));
  const body = $("stages").tBodies[0];
  body.replaceChildren();
  for (const w of s.workers) {
    if (w.sent_per_token == null) continue;
    const row = body.insertRow();
    row.className = "stage";
    cell(row, w.endpoint); cell(row, ms(w.wait)); cell(row, ms(w.busy));
    cell(row, bytes(w.sent_per_token)); cell(row, bytes(w.received_per_token));
  }
}

async function watch() {
  for (;;) {
    try {
      const response = await fetch("/pipeline/events", { headers: headers() });
      if (response.ok) await readEvents(response, (data) => show(JSON.parse(data)));
    } catch (err) { /* the server restarted or went away: try again */ }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

$("send").addEventListener("submit", send);
$("stop").addEventListener("click", () => controller && controller.abort());
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("go").click(); } });
watch();
