"""The status page mgmtd serves at ``/``: static HTML that polls ``/api/status``.

No build step and no outside assets: the page must load on a cluster with
no internet. Each node's row carries ``data-node`` and ``data-state``
attributes so that a test (headless Chromium) can read the state the page
shows.
"""

from __future__ import annotations

REFRESH_MS = 1000

PAGE = (
    """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>shufflefs status</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
 h1 { font-size: 1.4em; margin: 0 0 .2em; }
 h2 { font-size: 1.1em; margin: 1.4em 0 .4em; }
 table { border-collapse: collapse; background: #fff; }
 th, td { padding: .25em .8em; border-bottom: 1px solid #ddd; text-align: left; }
 th { background: #eee; }
 td.num { text-align: right; font-variant-numeric: tabular-nums; }
 .online, .serving { color: #176f2c; font-weight: 600; }
 .offline { color: #b00020; font-weight: 600; }
 .syncing, .waiting { color: #a15c00; font-weight: 600; }
 #meta { color: #666; }
 #error { color: #b00020; }
 .bar { display: inline-block; width: 12em; height: .8em; background: #ddd; }
 .bar span { display: block; height: 100%; background: #3572b0; }
</style>
</head>
<body>
<h1>shufflefs</h1>
<div id="meta">loading...</div>
<div id="error"></div>
<h2>Capacity</h2><div id="capacity"></div>
<h2>Nodes</h2>
<table id="nodes"><thead><tr><th>id</th><th>kind</th><th>state</th><th>address</th><th>host</th>
<th>IOPS</th><th>read/s</th><th>write/s</th><th>latency</th><th>metrics</th></tr></thead>
<tbody></tbody></table>
<h2>Mounts and clients</h2>
<table id="clients"><thead><tr><th>kind</th><th>name</th><th>IOPS</th><th>read/s</th>
<th>write/s</th><th>latency</th></tr></thead><tbody></tbody></table>
<h2>Targets</h2>
<table id="targets"><thead><tr><th>id</th><th>node</th><th>state</th><th>used</th><th>free</th>
<th>chunks</th><th>path</th></tr></thead><tbody></tbody></table>
<h2>Chains</h2>
<table id="chains"><thead><tr><th>id</th><th>version</th><th>targets (head first)</th></tr>
</thead><tbody></tbody></table>
<h2>Running jobs</h2><div id="jobs"></div>
<script>
"use strict";
const REFRESH_MS = """
    + str(REFRESH_MS)
    + """;
function human(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = Number(n), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : v.toFixed(0)) + " " + units[i];
}
function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}
function ioCells(tr, io) {
  if (!io) { for (let i = 0; i < 4; i++) tr.appendChild(cell("-", "num")); return; }
  tr.appendChild(cell(io.iops.toFixed(0), "num"));
  tr.appendChild(cell(human(io.read_bytes_per_s), "num"));
  tr.appendChild(cell(human(io.write_bytes_per_s), "num"));
  tr.appendChild(cell(io.latency_ms === null ? "-" : io.latency_ms.toFixed(2) + " ms", "num"));
}
function fill(id, rows, make) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows.map(make));
}
function render(s) {
  document.getElementById("meta").textContent =
    "cluster " + s.cluster_id + " \\u00b7 routing version " + s.version + " \\u00b7 replicas " +
    s.config.replicas + " \\u00b7 updated " + new Date(s.time * 1000).toLocaleTimeString();
  const c = s.capacity, frac = c.capacity ? c.used / c.capacity : 0;
  document.getElementById("capacity").innerHTML =
    '<span class="bar"><span style="width:' + (100 * frac).toFixed(1) + '%"></span></span> ';
  document.getElementById("capacity").appendChild(document.createTextNode(
    human(c.used) + " used of " + human(c.capacity) + ", " + human(c.free) + " free"));
  fill("nodes", s.nodes, n => {
    const tr = document.createElement("tr");
    tr.dataset.node = n.id; tr.dataset.state = n.state;
    [n.id, n.kind].forEach(v => tr.appendChild(cell(v)));
    tr.appendChild(cell(n.state, n.state));
    [n.address, n.host].forEach(v => tr.appendChild(cell(v)));
    ioCells(tr, n.io);
    tr.appendChild(cell(n.metrics || "-"));
    return tr;
  });
  fill("clients", s.clients, m => {
    const tr = document.createElement("tr");
    [m.kind, m.name].forEach(v => tr.appendChild(cell(v)));
    ioCells(tr, m.io);
    return tr;
  });
  fill("targets", s.targets, t => {
    const tr = document.createElement("tr");
    tr.dataset.target = t.id; tr.dataset.state = t.state;
    [t.id, t.node].forEach(v => tr.appendChild(cell(v, "num")));
    tr.appendChild(cell(t.state, t.state));
    tr.appendChild(cell(human(t.used), "num"));
    tr.appendChild(cell(human(t.free), "num"));
    tr.appendChild(cell(t.chunks, "num"));
    tr.appendChild(cell(t.path));
    return tr;
  });
  const states = Object.fromEntries(s.targets.map(t => [t.id, t.state]));
  fill("chains", s.chains, ch => {
    const tr = document.createElement("tr");
    [ch.id, ch.version].forEach(v => tr.appendChild(cell(v, "num")));
    const members = ch.targets.map(t => t + " (" + (states[t] || "?") + ")");
    tr.appendChild(cell(members.join(" \\u2192 ")));
    return tr;
  });
  document.getElementById("jobs").textContent = s.jobs.length
    ? s.jobs.map(j => j.id + " " + j.state + ": " + j.detail).join("; ")
    : "none";
}
async function poll() {
  try {
    const r = await fetch("/api/status", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = "mgmtd not answering: " + e.message;
  }
  setTimeout(poll, REFRESH_MS);
}
poll();
</script>
</body>
</html>
"""
)
