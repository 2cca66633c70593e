// The Encodings view, per scheme: its positional vectors, bias or rotation over the training
// length (a trace of the served model, without attention), how they depend on distance, and
// what `ordinal geometry` measured (report.js).
/* global d3, Plot */

import { get, post } from "./api.js";
import { LONG_PROMPT } from "./controls.js";
import { $, note, showError } from "./dom.js";
import { biasRaster, gateChart, heatmap, rotationChart, vectorHeatmap } from "./heatmap.js";
import { plot } from "./plot.js";
import { drawReport } from "./report.js";
import { BIAS_MEANING, LAYER_BIAS_MEANING, positionNote } from "./schemes.js";
import { model, modelInfo, state } from "./state.js";

async function positionalTrace(name) {
  if (!state.positional.has(name)) {
    const entry = modelInfo(name);
    const { tokens } = await post("/v1/tokenize", { model: name, prompt: LONG_PROMPT });
    // The positional pieces do not depend on the tokens: any prompt of the training length will do.
    const length = Math.min(entry.context_length, entry.max_context, 256) - 1;
    const prompt = Array.from({ length }, (_, i) => tokens[1 + (i % (tokens.length - 1))]);
    state.positional.set(name, await post("/v1/trace", { model: name, prompt, attention: false, top: 1 }));
  }
  return state.positional.get(name);
}

async function geometryReport(corpus) {
  if (!state.reports.has(corpus)) state.reports.set(corpus, await get(`/v1/geometry/${corpus}`));
  return state.reports.get(corpus);
}

export async function drawEncodings() {
  const name = model();
  const corpus = $("corpus").value;
  const stats = $("encodings-stats");
  stats.textContent = "loading…";
  try {
    const [trace, report] = await Promise.all([positionalTrace(name), corpus ? geometryReport(corpus) : null]);
    if (name !== model() || corpus !== $("corpus").value) return; // a later choice is drawing
    drawPositional(trace);
    if (report) drawReport(report, trace);
    const view = $("view-encodings");
    view.dataset.scheme = trace.scheme;
    view.dataset.drawn = String(Number(view.dataset.drawn || 0) + 1);
    stats.textContent = `${trace.model}: ${trace.scheme}, positions 0–${trace.tokens.length - 1} (its training length)`;
  } catch (error) {
    stats.textContent = "";
    showError($("encoding-chart"), error);
  }
}

// Left, what the scheme computes at each position; right, how it depends on distance.
function drawPositional(trace) {
  const left = $("encoding-chart");
  const [encoding, profile] = encodingOf(trace);
  left.replaceChildren(...encoding);
  $("distance-chart").replaceChildren(profile);
  left.dataset.drawn = String(Number(left.dataset.drawn || 0) + 1);
}

// [the charts of what the scheme computes, its profile by distance], by what the trace holds.
function encodingOf(trace) {
  if (trace.embedding.position_vectors) return addedVectors(trace);
  if (trace.position_bias) return scoreBias(trace);
  if (trace.forget_gates || trace.contextual_positions || trace.layer_bias) return dataDependent(trace);
  if (trace.rotation) return rotation(trace);
  return [
    [note(positionNote(trace.scheme))],
    note("No positional vectors and no bias: every distance looks the same to attention."),
  ];
}

// An absolute scheme: its vectors, and the profile the report measures: mean PE_i·PE_i+k over
// i, over the mean ‖PE_i‖².
function addedVectors(trace) {
  const length = trace.tokens.length;
  const vectors = trace.embedding.position_vectors;
  const dot = (a, b) => d3.sum(a, (value, i) => value * b[i]);
  const norm = d3.mean(vectors, (v) => dot(v, v));
  const points = d3.range(length).map((k) => ({
    distance: k, value: d3.mean(d3.range(length - k), (i) => dot(vectors[i], vectors[i + k])) / norm,
  }));
  return [
    [vectorHeatmap(vectors, 520, 330, `${trace.scheme}: the vector added at each position`)],
    distancePlot(points, { title: "dot product vs distance: mean PE_i·PE_i+k / mean ‖PE_i‖²", y: "dot product" }),
  ];
}

// alibi, t5, fire: a bias per head, and row T−1 of each: what the last query adds to a key d
// positions back.
function scoreBias(trace) {
  const length = trace.tokens.length;
  const heads = trace.position_bias.length;
  const size = heads > 4 ? 150 : 190;
  const points = trace.position_bias.flatMap((matrix, head) => matrix[length - 1].map((value, key) => ({
    distance: length - 1 - key, value, head: `head ${head}`,
  })));
  return [
    trace.position_bias.map((matrix, head) => biasRaster(matrix, head, size)),
    distancePlot(points, {
      title: `score bias vs distance (${BIAS_MEANING[trace.scheme] ?? "bias"})`,
      y: "added to the score", stroke: "head",
    }),
  ];
}

// fox, cope, path: what this prompt made of positions, in layer 0 (per head).
function dataDependent(trace) {
  const length = trace.tokens.length;
  const gates = trace.forget_gates;
  const counted = trace.contextual_positions;
  let encoding;
  if (gates) encoding = gateChart(gates);
  else if (counted) {
    encoding = heatmap(counted[0][0], {
      title: "cope, layer 0, head 0: the position of each key seen from each query",
      scheme: "Viridis", label: "contextual position", size: 330,
    });
  } else {
    encoding = heatmap(trace.layer_bias[0][0], {
      title: `${trace.scheme}, layer 0, head 0: what the tokens between key and query add to each score`,
      scheme: "RdBu", pivot: 0, label: "added to the score", size: 330,
    });
  }
  const perHead = counted ? counted[0] : trace.layer_bias[0];
  const points = perHead.flatMap((matrix, head) => matrix[length - 1].map((value, key) => ({
    distance: length - 1 - key, value, head: `head ${head}`,
  })));
  const meaning = trace.scheme === "fox"
    ? "Σ log f; a straight line would be alibi"
    : LAYER_BIAS_MEANING[trace.scheme] ?? "bias";
  const title = counted
    ? "layer 0: the last query's contextual position vs distance (the diagonal counts every token)"
    : `layer 0: the last query's bias vs distance (${meaning})`;
  return [[encoding], distancePlot(points, {
    title, y: counted ? "contextual position" : "added to the score", stroke: "head",
  })];
}

// rope: its angles, and q·k of one unit vector rotated at two positions d apart: the mean over
// pairs of cos(d·θ).
function rotation(trace) {
  const points = trace.rotation.map((angles, distance) => ({ distance, value: d3.mean(angles, Math.cos) }));
  return [
    [rotationChart(trace.rotation, 330, "rope: the rotation angle per position and dimension pair (mod 2π)", trace.positions)],
    distancePlot(points, {
      title: "how alike two positions d apart look after rope's rotation (mean cos of d × each frequency)", y: "dot product",
    }),
  ];
}

function distancePlot(points, { title, y, stroke }) {
  return plot({
    title, width: 440, height: 330, marginLeft: 50,
    x: { label: "distance (positions) →" }, y: { label: y, grid: true },
    color: stroke ? { legend: true } : undefined,
    marks: [Plot.ruleY([0]), Plot.lineY(points, { x: "distance", y: "value", stroke: stroke ?? "#3b5bdb", tip: true })],
  });
}
