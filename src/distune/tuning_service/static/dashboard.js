// The tuning service's live dashboard: polls /api/v1/status and, when a model's samples change,
// its CSV log, and draws one card per model with an SVG chart of the run (the chart that
// `distune plot` draws); with level 2, polls /api/v1/trials and shows a table of the trials. Plain JavaScript, no third-party code: the service serves all of it.
"use strict";

const TOKEN_KEY = "distune.service-token";
const POLL_MS = 1000;
const SVG_NS = "http://www.w3.org/2000/svg";
const PHASES = {
  default: "default group",
  initial: "initial (spread over the space)",
  bayes: "Bayesian optimization",
  confirm: "confirmation",
};
const CHART = { width: 760, height: 300, left: 58, right: 210, top: 14, bottom: 42 };

/** name -> {section, fields, svg, samples, state} */
const cards = new Map();
let polling = false;

class TokenNeeded extends Error {}

// --- the token -----------------------------------------------------------------------------

/** Move a ?token= (or #token=) from the address into this tab's storage, out of the address. */
function takeTokenFromAddress() {
  const url = new URL(window.location.href);
  const fromHash = new URLSearchParams(url.hash.slice(1)).get("token");
  const given = fromHash ?? url.searchParams.get("token");
  if (given === null) return;
  // A query decodes "+" as a space, and a token has no spaces: a base64 token (openssl rand
  // -base64) pasted into the address as it is keeps its "+".
  const token = given.replaceAll(" ", "+");
  sessionStorage.setItem(TOKEN_KEY, token);
  url.searchParams.delete("token");
  url.hash = "";
  history.replaceState(null, "", url.pathname + url.search);
}

async function get(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const response = await fetch(new URL(path, document.baseURI), { headers, cache: "no-store" });
  if (response.status === 401) {
    throw new TokenNeeded(token ? "The service refused this token." : "");
  }
  if (!response.ok) throw new Error(`${path} answered HTTP ${response.status}`);
  return response;
}

function askForToken(message) {
  const form = document.getElementById("token-form");
  document.getElementById("token-message").textContent = message;
  form.hidden = false;
  setConnection("waiting for the token", true);
  document.getElementById("token-input").focus();
}

function onTokenSubmitted(event) {
  event.preventDefault();
  const input = document.getElementById("token-input");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  document.getElementById("token-form").hidden = true;
  startPolling();
}

// --- words, as the command line tools write them -----------------------------------------------

function humanBytes(size) {
  for (const [unit, shift] of [["GiB", 30], ["MiB", 20], ["KiB", 10]]) {
    if (size >= 2 ** shift) return `${size / 2 ** shift} ${unit}`;
  }
  return `${size} B`;
}

function describe(bucketSize2p, hierarchical) {
  const shape = hierarchical ? "hierarchical" : "flat";
  return `bucket 2^${bucketSize2p} B (${humanBytes(2 ** bucketSize2p)}), ${shape}`;
}

function describeGroup(group) {
  if (!group || !group.hyperparameters) return "-";
  const hp = group.hyperparameters;
  return describe(hp.bucket_size_2p, hp.is_hierarchical_reduce);
}

function rate(value) {
  return Number.isFinite(value) ? `${Number(value.toPrecision(4))} it/s` : "-";
}

function gain(value) {
  if (!Number.isFinite(value)) return "-";
  const percent = (100 * value).toFixed(1);
  // A score equal to the default's reads +0.0%, not the -0.0% of a rounding error.
  return percent === "-0.0" ? "+0.0%" : `${value >= 0 ? "+" : ""}${percent}%`;
}

// --- the log -----------------------------------------------------------------------------------

/** The rows of a CSV text (RFC 4180 quoting) as objects keyed by the header. */
function parseCsv(text) {
  const rows = [];
  let row = [];
  let field = "";
  let quoted = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (quoted) {
      if (c === '"' && text[i + 1] === '"') {
        field += '"';
        i++;
      } else if (c === '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c === '"') {
      quoted = true;
    } else if (c === ",") {
      row.push(field);
      field = "";
    } else if (c === "\n" || c === "\r") {
      if (c === "\r" && text[i + 1] === "\n") i++;
      row.push(field);
      rows.push(row);
      row = [];
      field = "";
    } else {
      field += c;
    }
  }
  if (field !== "" || row.length) {
    row.push(field);
    rows.push(row);
  }
  const [header = [], ...body] = rows;
  return body
    .filter((cells) => cells.length === header.length)
    .map((cells) => Object.fromEntries(header.map((name, i) => [name, cells[i]])));
}

function logRecords(text) {
  return parseCsv(text).map((row) => ({
    sample: Number(row.sample),
    phase: row.phase,
    bucketSize2p: Number(row.bucket_size_2p),
    hierarchical: row.is_hierarchical_reduce === "True",
    score: Number(row.score),
    iteration: Number(row.train_iter),
    gain: Number(row.gain_vs_default),
    groupId: Number(row.group_id),
  }));
}

// --- the chart ---------------------------------------------------------------------------------

function svg(parent, name, attributes = {}, text = null) {
  const element = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text !== null) element.textContent = text;
  parent.appendChild(element);
  return element;
}

/** Round tick values covering [low, high], about `count` of them. */
function ticks(low, high, count) {
  const rough = (high - low) / count;
  const magnitude = 10 ** Math.floor(Math.log10(rough));
  const ratio = rough / magnitude;
  const step = magnitude * (ratio >= 7.5 ? 10 : ratio >= 3.5 ? 5 : ratio >= 1.5 ? 2 : 1);
  const values = [];
  for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) {
    values.push(Number(v.toPrecision(12)));
  }
  return values;
}

function padded(values, fraction) {
  let low = Math.min(...values);
  let high = Math.max(...values);
  if (high === low) {
    low -= Math.abs(low) * 0.1 || 1;
    high += Math.abs(high) * 0.1 || 1;
  }
  const pad = (high - low) * fraction;
  return [low - pad, high + pad];
}

function starPoints(cx, cy, outer, inner) {
  const points = [];
  for (let i = 0; i < 10; i++) {
    const radius = i % 2 ? inner : outer;
    const angle = -Math.PI / 2 + (i * Math.PI) / 5;
    points.push(`${cx + radius * Math.cos(angle)},${cy + radius * Math.sin(angle)}`);
  }
  return points.join(" ");
}

/** Draw the run into `chart`: samples against iteration, default level, running best, choice. */
function drawChart(chart, records, model) {
  chart.replaceChildren();
  const samples = records.filter((r) => r.phase !== "completed").sort((a, b) => a.sample - b.sample);
  const chosen = records.find((r) => r.phase === "completed");
  chart.dataset.samples = String(samples.length);
  const { width, height, left, right, top, bottom } = CHART;
  const plotRight = width - right;
  const plotBottom = height - bottom;
  if (!samples.length) {
    svg(chart, "text", { x: left, y: height / 2, class: "waiting" },
      `waiting for the first sample (${model.state})`);
    return;
  }
  const first = samples[0];
  const defaultScore = Number.isFinite(model.default_score)
    ? model.default_score : first.score / (1 + first.gain);
  const points = chosen ? [...samples, chosen] : samples;
  const [x0, x1] = padded(points.map((r) => r.iteration), 0.04);
  const [y0, y1] = padded([...points.map((r) => r.score), defaultScore], 0.12);
  const x = (v) => left + ((v - x0) / (x1 - x0)) * (plotRight - left);
  const y = (v) => plotBottom - ((v - y0) / (y1 - y0)) * (plotBottom - top);

  for (const v of ticks(y0, y1, 5)) {
    svg(chart, "line", { x1: left, x2: plotRight, y1: y(v), y2: y(v), class: "grid" });
    svg(chart, "text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, String(v));
  }
  for (const v of ticks(x0, x1, 6)) {
    svg(chart, "line", { x1: x(v), x2: x(v), y1: top, y2: plotBottom, class: "grid" });
    svg(chart, "text", { x: x(v), y: plotBottom + 16, "text-anchor": "middle" }, String(v));
  }
  svg(chart, "rect", { x: left, y: top, width: plotRight - left, height: plotBottom - top,
    fill: "none", class: "axis" });
  svg(chart, "text", { x: (left + plotRight) / 2, y: height - 6, "text-anchor": "middle",
    class: "axis-label" }, "training iteration");
  svg(chart, "text", { x: 14, y: (top + plotBottom) / 2, "text-anchor": "middle",
    transform: `rotate(-90 14 ${(top + plotBottom) / 2})`, class: "axis-label" },
  "throughput (it/s)");

  svg(chart, "line", { x1: left, x2: plotRight, y1: y(defaultScore), y2: y(defaultScore),
    class: "default-level" });
  svg(chart, "polyline", { class: "path",
    points: samples.map((r) => `${x(r.iteration)},${y(r.score)}`).join(" ") });
  let best = -Infinity;
  const steps = [];
  samples.forEach((r, i) => {
    best = Math.max(best, r.score);
    const next = i + 1 < samples.length ? samples[i + 1].iteration : r.iteration;
    steps.push(`${x(r.iteration)},${y(best)}`, `${x(next)},${y(best)}`);
  });
  svg(chart, "polyline", { class: "running-best", points: steps.join(" ") });

  // Every point's gain divides by the level drawn, the default's score as the service judges
  // it now (a row's logged gain divided by the default's score when it was logged); that is
  // the default's first sample alone until it is measured again, as the progress lines say.
  const versus = samples.filter((r) => r.bucketSize2p === first.bucketSize2p
    && r.hierarchical === first.hierarchical).length > 1
    ? "vs default" : "vs the default's first sample";
  for (const r of samples) {
    const known = r.phase in PHASES ? r.phase : "initial";
    const point = svg(chart, "circle", { cx: x(r.iteration), cy: y(r.score), r: 5,
      class: `mark sample phase-${known}`, "data-sample": r.sample });
    const said = r === first ? "the default group" : `${gain(r.score / defaultScore - 1)} ${versus}`;
    svg(point, "title", {}, `sample ${r.sample} (${r.phase}): ${describe(r.bucketSize2p,
      r.hierarchical)} -> ${rate(r.score)} (${said}) at iteration ${r.iteration}`);
    svg(chart, "text", { x: x(r.iteration), y: y(r.score) - 9, "text-anchor": "middle",
      class: "point-label" }, `2^${r.bucketSize2p}${r.hierarchical ? " h" : ""}`);
  }
  if (chosen) {
    const star = svg(chart, "polygon", { class: "chosen",
      points: starPoints(x(chosen.iteration), y(chosen.score), 11, 4.5) });
    svg(star, "title", {}, `chosen: ${describe(chosen.bucketSize2p, chosen.hierarchical)} -> `
      + `${rate(chosen.score)} (${gain(chosen.gain)} vs default)`);
  }
  const phases = new Set(samples.map((r) => (r.phase in PHASES ? r.phase : "initial")));
  drawLegend(chart, plotRight + 16, top + 6, phases, defaultScore, chosen);
}

function drawLegend(chart, left, top, phases, defaultScore, chosen) {
  const shown = Object.entries(PHASES).filter(([phase]) => phases.has(phase));
  const entries = shown.map(([phase, label]) => [(g, cy) =>
    svg(g, "circle", { cx: left + 8, cy, r: 5, class: `mark phase-${phase}` }), label]);
  entries.push([(g, cy) => svg(g, "line", { x1: left, x2: left + 16, y1: cy, y2: cy,
    class: "running-best" }), "running best"]);
  entries.push([(g, cy) => svg(g, "line", { x1: left, x2: left + 16, y1: cy, y2: cy,
    class: "default-level" }), `default group level (${rate(defaultScore)})`]);
  if (chosen) {
    entries.push([(g, cy) => svg(g, "polygon", { class: "chosen",
      points: starPoints(left + 8, cy, 8, 3.3) }), "chosen group"]);
  }
  const legend = svg(chart, "g", { class: "legend" });
  entries.forEach(([mark, label], i) => {
    const cy = top + i * 18;
    mark(legend, cy);
    svg(legend, "text", { x: left + 24, y: cy + 4 }, label);
  });
}

// --- the cards ---------------------------------------------------------------------------------

function card(name) {
  if (cards.has(name)) return cards.get(name);
  const section = document.createElement("section");
  section.className = "model";
  section.dataset.model = name;
  const title = section.appendChild(document.createElement("h2"));
  const label = title.appendChild(document.createElement("span"));
  label.className = "name";
  label.textContent = name;
  const state = title.appendChild(document.createElement("span"));
  const facts = section.appendChild(document.createElement("dl"));
  facts.className = "facts";
  const fields = { state };
  for (const [key, label] of [["samples", "samples"], ["current", "current group"],
    ["best", "best group so far"], ["default", "default group"]]) {
    const term = facts.appendChild(document.createElement("dt"));
    term.textContent = label;
    fields[`${key}Label`] = term;
    fields[key] = facts.appendChild(document.createElement("dd"));
    fields[key].className = key;
  }
  const chart = document.createElementNS(SVG_NS, "svg");
  chart.setAttribute("class", "chart");
  chart.setAttribute("viewBox", `0 0 ${CHART.width} ${CHART.height}`);
  chart.setAttribute("role", "img");
  chart.setAttribute("aria-label", `throughput of ${name}'s samples against training iteration`);
  chart.dataset.samples = "0";
  section.appendChild(chart);
  const entry = { section, fields, chart, samples: -1, state: "" };
  cards.set(name, entry);
  // Keep the cards in name order.
  const names = [...cards.keys()].sort();
  const after = names[names.indexOf(name) + 1];
  document.getElementById("models").insertBefore(section, after ? cards.get(after).section : null);
  return entry;
}

function fillCard(entry, model) {
  const { fields } = entry;
  fields.state.textContent = model.state;
  fields.state.className = `state state-${model.state}`;
  fields.samples.textContent = `${model.samples} / ${model.max_samples}`;
  fields.current.textContent = describeGroup(model.current);
  const best = model.best;
  fields.bestLabel.textContent = model.state === "completed" ? "chosen group" : "best group so far";
  fields.best.textContent = best
    ? `${describeGroup(best.group)} -> ${rate(best.score)} (${gain(best.gain_vs_default)} vs default)`
    : "-";
  fields.default.textContent = rate(model.default_score);
}

/** The rows of the model's latest registration: one registered again with other facts is tuned
 * afresh in a session whose group ids are above every id of the earlier ones (its status's
 * `earlier`), none of its rows before its first sample ends. */
function latestRegistration(records, model) {
  const earlier = (model.earlier || []).map((e) => e.current.id);
  const last = earlier.length ? Math.max(...earlier) : -1;
  return records.filter((r) => r.groupId > last);
}

async function refreshChart(entry, name, model) {
  if (entry.samples === model.samples && entry.state === model.state) return;
  const response = await get(`api/v1/models/${encodeURIComponent(name)}/log`);
  drawChart(entry.chart, latestRegistration(logRecords(await response.text()), model), model);
  entry.samples = model.samples;
  entry.state = model.state;
}

// --- level 2's trials --------------------------------------------------------------------------

const STRATEGIES = ["ddp", "zero1", "zero2", "zero3"];

function mebibytes(value) {
  return typeof value === "number" ? `${(value / 2 ** 20).toFixed(1)} MiB` : "-";
}

function trialStrategy(config) {
  if (!config) return "?";
  const stage = (config.zero_optimization || {}).stage;
  const name = STRATEGIES[stage] ?? "?";
  return config.activation_checkpointing ? `${name} + checkpointing` : name;
}

function trialBatches(config) {
  if (!config) return "script's own";
  return `${config.train_micro_batch_size_per_gpu} x ${config.gradient_accumulation_steps}`;
}

function trialsHeadline(trials) {
  const nodes = trials.nnodes === null ? "" : ` on ${trials.nnodes} node${trials.nnodes === 1 ? "" : "s"}`;
  const parts = [`${trials.state}${nodes}`, `${trials.trials.length} trials recorded`];
  if (trials.running) {
    const spec = trials.running.spec || {};
    const reported = Object.keys(trials.running.nodes).length;
    parts.push(`trial ${trials.running.trial} running (${spec.purpose}, ` +
      `${trialBatches(spec.config)}), ${reported} of ${spec.nnodes} nodes reported`);
  }
  if (trials.best !== null) {
    const chosen = trials.finish && trials.finish.chosen === trials.best;
    parts.push(`${chosen ? "chosen" : "best so far"}: trial ${trials.best}`);
  }
  if (trials.stop) parts.push(`stopped by node ${trials.stop.node_rank} (${trials.stop.reason})`);
  return parts.join("; ");
}

function showTrials(trials) {
  const section = document.getElementById("trials");
  section.hidden = trials === null || (trials.state === "waiting" && trials.trials.length === 0);
  if (section.hidden) return;
  document.getElementById("trials-headline").textContent = trialsHeadline(trials);
  const body = document.querySelector("#trials-table tbody");
  const rows = trials.trials.map((record) => {
    const row = document.createElement("tr");
    row.classList.toggle("best", record.trial === trials.best);
    const cells = [
      [String(record.trial), ""],
      [record.purpose ?? "?", ""],
      [trialStrategy(record.config), ""],
      [trialBatches(record.config), ""],
      [record.outcome, `outcome-${record.outcome}`],
      [typeof record.throughput === "number"
        ? `${Number(record.throughput.toPrecision(4))} samples/s` : "-", ""],
      [typeof record.throughput_spread === "number"
        ? `${(100 * record.throughput_spread).toFixed(0)}%` : "-", ""],
      [mebibytes(record.predicted_memory_bytes), ""],
      [mebibytes(record.peak_memory_bytes), ""],
      [record.error ? record.error.split("\n").filter(Boolean).pop() : "", "error"],
    ];
    for (const [text, className] of cells) {
      const cell = row.appendChild(document.createElement("td"));
      cell.textContent = text;
      if (className) cell.className = className;
      if (className === "error") cell.title = record.error || "";
    }
    return row;
  });
  body.replaceChildren(...rows);
}

async function pollTrials() {
  try {
    return await (await get("api/v1/trials")).json();
  } catch (error) {
    if (error instanceof TokenNeeded) throw error;
    return null; // a service without trial endpoints
  }
}

// --- polling -----------------------------------------------------------------------------------

function setConnection(text, error = false) {
  const element = document.getElementById("connection");
  element.textContent = text;
  element.classList.toggle("error", error);
}

async function poll() {
  try {
    const status = await (await get("api/v1/status")).json();
    const trials = await pollTrials();
    showTrials(trials);
    const names = Object.keys(status.models).sort();
    const trialsShown = !document.getElementById("trials").hidden;
    document.getElementById("no-models").hidden = names.length > 0 || trialsShown;
    for (const name of names) {
      const entry = card(name);
      fillCard(entry, status.models[name]);
      await refreshChart(entry, name, status.models[name]);
    }
    setConnection(`updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    if (error instanceof TokenNeeded) {
      polling = false;
      askForToken(error.message);
      return;
    }
    setConnection(`cannot reach the tuning service (${error.message}); retrying`, true);
  }
  setTimeout(poll, POLL_MS);
}

function startPolling() {
  if (polling) return;
  polling = true;
  poll();
}

document.getElementById("token-form").addEventListener("submit", onTokenSubmitted);
takeTokenFromAddress();
startPolling();
