// The Inside view: one forward pass, panel by panel (tokens, embeddings, attention, position
// against content, the next token, where its logit comes from, the logit lens), changed by the
// experiments. Four kinds of trace, so that a slider never re-fetches what it does not change:
//   the baseline (no experiment; attention, full next-token distribution), cached per prompt;
//   the experiment's (the same with the interventions, and the logit lens if asked);
//   the stages (sampling settings only, attention false), re-fetched when a slider moves;
//   the head's score split and the target's attribution (parts.js, attribution.js), each cached.
/* global d3, Plot */

import { post } from "./api.js";
import { drawAttention, unpackAttention } from "./attention.js";
import { drawAttribution } from "./attribution.js";
import { SURPRISAL_MAX } from "./colour.js";
import { interventions, samplingSettings } from "./controls.js";
import { $, fillSelect, note, showError, visible } from "./dom.js";
import { drawEffect, fillExperimentControls, setPreset } from "./experiments.js";
import { vectorHeatmap } from "./heatmap.js";
import { drawParts, scheduleParts } from "./parts.js";
import { plot } from "./plot.js";
import { positionNote } from "./schemes.js";
import { stagesChart } from "./stages.js";
import { model, state } from "./state.js";
import { fillTargets, restoreAttentionChoice, saveState } from "./url.js";

const FULL = 65536; // `top` for the whole vocabulary: the total variation needs every token

function traceKey() {
  return JSON.stringify([model(), $("prompt").value, interventions(), $("lens").checked]);
}

export function scheduleTrace() {
  clearTimeout(state.traceTimer);
  state.traceTimer = setTimeout(runTrace, 150);
}

export function scheduleStages() {
  clearTimeout(state.traceTimer);
  state.traceTimer = setTimeout(runStages, 120);
}

export function applyPreset(name) {
  if (setPreset(name)) runTrace();
}

async function cachedTrace(body) {
  const key = JSON.stringify(body);
  if (!state.traces.has(key)) {
    if (state.traces.size > 16) state.traces.clear();
    state.traces.set(key, post("/v1/trace", body).catch((error) => { state.traces.delete(key); throw error; }));
  }
  return state.traces.get(key);
}

export async function runTrace() {
  const key = traceKey();
  const stats = $("trace-stats");
  stats.textContent = "tracing…";
  const base = { model: model(), prompt: $("prompt").value, top: FULL, attention_encoding: "uint8" };
  const changes = interventions();
  const experiment = Object.keys(changes).length > 0;
  try {
    const started = performance.now();
    const asked = experiment || $("lens").checked;
    const [baseline, changed] = await Promise.all([
      cachedTrace(base),
      asked ? cachedTrace({ ...base, ...changes, logit_lens: $("lens").checked }).catch((error) => error) : null,
    ]);
    if (key !== traceKey()) return; // a later change is tracing
    if (changed instanceof Error) { // e.g. an offset past a table's last row: say so, keep the rest
      $("offset-effect").textContent = changed.message;
      $("offset-effect").classList.add("error");
      stats.textContent = "";
      return;
    }
    $("offset-effect").classList.remove("error");
    const trace = changed ?? baseline;
    state.lastTrace = { key, trace, baseline, attention: unpackAttention(trace) };
    state.baseAttention = changed ? unpackAttention(baseline) : state.lastTrace.attention;
    drawPipeline(trace, experiment ? baseline : null);
    drawEffect(trace, baseline, experiment);
    await runStages();
    stats.textContent = `${trace.tokens.length} tokens (limit ${trace.limit}) · ${trace.model}: ${trace.scheme} · ${Math.round(performance.now() - started)} ms`;
    saveState();
    // one after the other: the server runs at most a few traces per model at once
    await drawParts();
    await drawAttribution();
  } catch (error) {
    stats.textContent = "";
    for (const id of ["tokens-chart", "embedding-chart", "attention-chart", "position-chart", "stages-chart", "heads",
      "parts-chart", "frequency-chart", "attribution-chart"]) {
      $(id).replaceChildren();
    }
    for (const id of ["offset-effect", "parts-readout", "attribution-readout"]) $(id).textContent = "";
    showError($("tokens-chart"), error);
  }
}

async function runStages() {
  try {
    const trace = await post("/v1/trace", {
      model: model(), prompt: $("prompt").value, ...interventions(), ...samplingSettings(), top: 15, attention: false,
    });
    const target = $("stages-chart");
    target.replaceChildren(stagesChart(trace, null, target.clientWidth));
    target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);
  } catch (error) {
    $("stages-chart").replaceChildren();
    showError($("stages-chart"), error);
  }
}

function drawPipeline(trace, baseline) {
  const labels = trace.tokens.map((t) => visible(t.text));
  // the URL's or a preset's boxes, which did not exist before this trace
  if (fillExperimentControls(trace)) scheduleTrace();
  drawTokens(trace, baseline, labels);
  drawEmbeddings(trace, labels.length);
  fillSelect($("layer"), trace.n_layers, "layer");
  fillSelect($("head"), trace.n_heads, "head");
  restoreAttentionChoice();
  for (const what of ["layer", "head"]) $(`parts-${what}`).replaceChildren(...[...$(what).options].map((o) => new Option(o.text, o.value)));
  showHead("attention");
  fillTargets($("target"), trace.next_token.stages[0].top.slice(0, 10), "the most probable");
  drawAttention();
  drawLens(trace);
}

// Panel 3's layer and head pickers and panel 4's are one choice: `from` the one just changed.
function showHead(from) {
  for (const what of ["layer", "head"]) {
    const [source, copy] = from === "parts" ? [`parts-${what}`, what] : [what, `parts-${what}`];
    $(copy).value = $(source).value;
  }
}

// The head chosen in either panel (or by a click on a small multiple): both panels redraw.
export function chooseHead(from) {
  showHead(from);
  drawAttention();
  scheduleParts();
  saveState();
}

// 1. Tokens and their surprisal (the unchanged pass as ticks, when an experiment is on).
function drawTokens(trace, baseline, labels) {
  const length = labels.length;
  const positionTick = length <= 48 ? (i) => labels[i] : (i) => (i % 16 === 0 ? i : "");
  const surprisal = trace.surprisal.map((bits, position) => ({ position, bits: bits ?? 0, token: labels[position] }));
  const before = baseline ? baseline.surprisal.map((bits, position) => ({ position, bits: bits ?? 0 })) : [];
  $("tokens-chart").replaceChildren(plot({
    width: Math.min(1100, Math.max(560, 22 * length)),
    height: length <= 48 ? 210 : 170,
    marginBottom: length <= 48 ? 70 : 34,
    x: { type: "band", label: "position", tickFormat: positionTick, tickRotate: length <= 48 ? -50 : 0 },
    y: { label: "bits", grid: true },
    color: { type: "linear", domain: [0, SURPRISAL_MAX], scheme: "viridis", reverse: true },
    marks: [
      Plot.barY(surprisal, { x: "position", y: "bits", fill: "bits", title: (d) => `${d.position}: ${d.token} — ${d.bits.toFixed(2)} bits` }),
      Plot.tickY(before, { x: "position", y: "bits", stroke: "#111", strokeWidth: 2 }),
      Plot.ruleY([0]),
    ],
  }));
}

// 2. Embeddings: norms per position, and the positional vectors as a heatmap.
function drawEmbeddings(trace, length) {
  const norms = trace.tokens.flatMap((_, position) => [
    { position: trace.positions[position], norm: trace.embedding.token_norm[position], kind: "token embedding" },
    ...(trace.embedding.position_norm
      ? [{ position: trace.positions[position], norm: trace.embedding.position_norm[position], kind: "positional vector" }]
      : []),
  ]);
  const parts = [plot({
    width: 420, height: 260,
    x: { label: "position" }, y: { label: "‖vector‖", grid: true, zero: true },
    color: { legend: true, domain: ["token embedding", "positional vector"], range: ["#3b5bdb", "#c2410c"] },
    marks: [Plot.lineY(norms, { x: "position", y: "norm", stroke: "kind", marker: length <= 48 ? "dot" : null })],
  })];
  const vectors = trace.embedding.position_vectors;
  parts.push(vectors ? vectorHeatmap(vectors, 460, 280) : note(positionNote(trace.scheme)));
  $("embedding-chart").replaceChildren(...parts);
}

// 4. The logit lens: a layer × position grid of each layer's top-1 token, shaded by
// probability; a thick border on the first layer whose top-1 is already the last layer's.
function drawLens(trace) {
  const panel = $("lens-panel");
  const lens = trace.logit_lens;
  panel.hidden = !lens;
  if (!lens) return;
  const layers = lens.ids.length;
  const length = trace.tokens.length;
  const table = document.createElement("table");
  table.className = "lens";
  const head = table.createTHead().insertRow();
  const corner = document.createElement("th");
  corner.textContent = "layer \\ after";
  head.append(corner);
  for (let position = 0; position < length; position++) {
    const cell = document.createElement("th");
    cell.scope = "col";
    cell.textContent = visible(trace.tokens[position].text);
    head.append(cell);
  }
  const settled = d3.range(length).map((position) => {
    const final = lens.ids[layers - 1][position][0];
    return d3.range(layers).find((layer) => lens.ids[layer][position][0] === final);
  });
  const body = table.createTBody();
  for (let layer = 0; layer < layers; layer++) {
    const row = body.insertRow();
    const name = document.createElement("th");
    name.scope = "row";
    name.textContent = layer === layers - 1 ? `${layer} (served)` : String(layer);
    row.append(name);
    for (let position = 0; position < length; position++) {
      const cell = row.insertCell();
      const p = lens.probs[layer][position][0];
      cell.textContent = visible(lens.texts[layer][position][0]);
      cell.style.background = d3.interpolateCividis(1 - p * 0.85);
      cell.style.color = p > 0.45 ? "#fff" : "#111";
      cell.title = lens.texts[layer][position].map((text, i) => `${visible(text)} ${lens.probs[layer][position][i].toFixed(3)}`).join(" · ");
      if (settled[position] === layer) cell.classList.add("settled");
    }
  }
  $("lens-chart").replaceChildren(table);
  $("lens-chart").dataset.settled = JSON.stringify(settled);
}
