// Heatmaps. Attention and the score biases (up to 256 × 256 cells per head) are drawn to canvas
// as one pixel per cell, scaled; the positional vectors, rotation angles, gates and small biases
// are Observable Plot rasters and cells.
/* global d3, Plot */

import { ATTENTION_COLOURS, signedColour } from "./colour.js";
import { plot } from "./plot.js";

// One head's lower triangle as an image of length × length pixels (one per query and key).
export function headImage(attention, layer, head) {
  const { data, heads, length } = attention;
  const size = (length * (length + 1)) / 2;
  const offset = (layer * heads + head) * size;
  const image = new ImageData(length, length);
  const pixels = image.data;
  pixels.fill(255);
  let index = offset;
  for (let q = 0; q < length; q++) {
    for (let k = 0; k <= q; k++) {
      const level = data[index++];
      pixels.set(ATTENTION_COLOURS.subarray(level * 4, level * 4 + 4), (q * length + k) * 4);
    }
  }
  return image;
}

export function weightAt(attention, layer, head, q, k) {
  const size = (attention.length * (attention.length + 1)) / 2;
  return attention.data[(layer * attention.heads + head) * size + (q * (q + 1)) / 2 + k] / 255;
}

// An image scaled onto a canvas of `size` CSS pixels, crisp (no smoothing), inside margins.
export function imageCanvas(image, size, margin) {
  const canvas = document.createElement("canvas");
  const ratio = window.devicePixelRatio || 1;
  const full = size + margin.left + margin.right;
  const tall = size + margin.top + margin.bottom;
  canvas.width = Math.round(full * ratio);
  canvas.height = Math.round(tall * ratio);
  canvas.style.width = `${full}px`;
  canvas.style.maxWidth = "100%";
  const source = document.createElement("canvas");
  source.width = image.width;
  source.height = image.height;
  source.getContext("2d").putImageData(image, 0, 0);
  const context = canvas.getContext("2d");
  context.scale(ratio, ratio);
  context.imageSmoothingEnabled = false;
  context.fillStyle = "#fff";
  context.fillRect(0, 0, full, tall);
  context.drawImage(source, margin.left, margin.top, size, size);
  return { canvas, context };
}

// Token labels along both axes of a heatmap (every token when they fit, else every k-th).
export function labelAxes(context, labels, size, margin) {
  const length = labels.length;
  const cell = size / length;
  const every = Math.max(1, Math.ceil(11 / cell));
  context.fillStyle = "#1d1d1f";
  context.font = `${Math.min(11, Math.max(8, cell))}px ui-monospace, monospace`;
  for (let i = 0; i < length; i += every) {
    const text = labels[i].length > 8 ? `${labels[i].slice(0, 7)}…` : labels[i];
    context.textAlign = "right";
    context.textBaseline = "middle";
    context.fillText(text, margin.left - 3, margin.top + (i + 0.5) * cell);
    context.save();
    context.translate(margin.left + (i + 0.5) * cell, margin.top + size + 3);
    context.rotate(-Math.PI / 3);
    context.fillText(text, 0, 0);
    context.restore();
  }
  context.textAlign = "left";
  context.fillText("↓ query (reads)", 2, 10);
  context.textAlign = "right";
  context.fillText("key (is read) →", margin.left + size, margin.top + size + margin.bottom - 4);
}

// alibi's or t5's bias [T][q+1] on a canvas, diverging around 0 (orange below, purple above).
export function biasHeatmap(matrix, size, text) {
  const length = matrix.length;
  const extent = d3.max(matrix, (row) => d3.max(row, Math.abs)) || 1;
  const colour = signedColour(extent);
  const image = new ImageData(length, length);
  image.data.fill(255);
  for (let q = 0; q < length; q++) {
    for (let k = 0; k <= q; k++) {
      const c = d3.rgb(colour(matrix[q][k]));
      image.data.set([c.r, c.g, c.b, 255], (q * length + k) * 4);
    }
  }
  const margin = { left: 40, right: 8, top: 16, bottom: 30 };
  const { canvas, context } = imageCanvas(image, size, margin);
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", text);
  context.fillStyle = "#1d1d1f";
  context.font = "11px system-ui, sans-serif";
  context.fillText(`range ${(-extent).toFixed(2)} … ${extent.toFixed(2)} (added to the score)`, margin.left, margin.top + size + 20);
  const title = document.createElement("p");
  title.className = "chart-title";
  title.textContent = text;
  const wrap = document.createElement("div");
  wrap.dataset.cells = String((length * (length + 1)) / 2);
  wrap.className = "bias";
  wrap.append(title, canvas);
  return wrap;
}

// The positional vectors [T][d_model] as a position × dimension heatmap.
export function vectorHeatmap(vectors, width, height, title) {
  const cells = vectors.flatMap((row, position) => row.map((value, dim) => ({ position, dim, value })));
  // A symmetric domain at the 99th percentile of |value|, so that a few large entries do not
  // wash out the rest (integer's grow without bound).
  const extent = d3.quantile(cells, 0.99, (d) => Math.abs(d.value)) || 1;
  return plot({
    title, width, height, marginLeft: 44,
    x: { label: "dimension", ticks: 8 }, y: { label: "position", reverse: false, ticks: 8 },
    color: { type: "linear", scheme: "RdBu", domain: [-extent, extent], clamp: true, legend: true, label: "value added" },
    marks: [Plot.raster(cells, { x: "dim", y: "position", fill: "value", interpolate: "none", imageRendering: "pixelated", width: vectors[0].length, height: vectors.length })],
  });
}

// rope's rotation angles [T][pairs] (mod 2π) as a position × dimension-pair heatmap.
// `positions`: each row's position (the trace's, moved by an offset experiment).
export function rotationChart(rotation, height, title, positions) {
  const cells = rotation.flatMap((row, index) => row.map((angle, pair) => ({
    position: positions[index], pair, angle: ((angle % (2 * Math.PI)) + 2 * Math.PI) % (2 * Math.PI),
  })));
  const every = rotation.length <= 24 ? 2 : 16;
  return plot({
    title, width: 360, height, marginLeft: 44, padding: 0,
    x: { type: "band", label: "dimension pair (fast → slow) →", tickFormat: (i) => (i % 4 === 0 ? i : "") },
    y: { type: "band", label: "↓ position", tickFormat: (i) => (i % every === 0 ? i : "") },
    color: { type: "linear", domain: [0, 2 * Math.PI], scheme: "Sinebow", label: "angle (rad)", legend: true },
    marks: [Plot.cell(cells, { x: "pair", y: "position", fill: "angle", inset: 0 })],
  });
}

// A query × key matrix's lower triangle as Plot cells (cope's contextual positions).
export function heatmap(matrix, { title, scheme, label, size, type = "linear", pivot, domain }) {
  const length = matrix.length;
  const cells = [];
  for (let q = 0; q < length; q++) {
    for (let k = 0; k <= q; k++) {
      const value = matrix[q][k];
      if (value !== null && value !== undefined) cells.push({ q, k, value });
    }
  }
  const every = length <= 24 ? 2 : length <= 64 ? 8 : 16;
  const ticks = (i) => (i % every === 0 ? i : "");
  return Plot.plot({
    title, width: size + 70, height: size + 60, marginLeft: 44, padding: 0,
    x: { type: "band", domain: d3.range(length), label: "key position →", tickFormat: ticks },
    y: { type: "band", domain: d3.range(length), label: "↓ query position", tickFormat: ticks },
    color: { type, scheme, label, legend: true, ...(pivot === undefined ? {} : { pivot }), ...(domain ? { domain } : {}) },
    marks: [Plot.cell(cells, { x: "k", y: "q", fill: "value", inset: 0, title: (d) => `query ${d.q}, key ${d.k}: ${d.value.toFixed(4)}` })],
  });
}

// fox's forget gates [layers][heads][T] as a (layer, head) × position heatmap.
export function gateChart(gates) {
  const cells = gates.flatMap((heads, layer) => heads.flatMap((row, head) => row.map((value, position) => ({
    row: `layer ${layer} head ${head}`, position, value,
  }))));
  return Plot.plot({
    title: "fox: the forget gate f of each token, per layer and head (1 = remember everything)",
    width: 520, height: 60 + 16 * gates.length * gates[0].length, marginLeft: 110,
    x: { type: "band", domain: d3.range(gates[0][0].length), label: "position →", tickFormat: (i) => (i % 16 === 0 ? i : "") },
    y: { label: null },
    color: { type: "linear", scheme: "Greens", domain: [0, 1], legend: true, label: "f" },
    marks: [Plot.cell(cells, { x: "position", y: "row", fill: "value", inset: 0, title: (d) => `${d.row}, position ${d.position}: ${d.value.toFixed(3)}` })],
  });
}

// One head's score bias [T][T] as a raster, on its own scale from its most negative bias to 0.
export function biasRaster(matrix, head, size) {
  const length = matrix.length;
  const cells = matrix.flatMap((row, q) => row.map((value, k) => ({ q, k, value })));
  return plot({
    title: `head ${head}`, width: size + 40, height: size + 40, marginLeft: 34, marginBottom: 34,
    x: { domain: [0, length], label: "key →", ticks: 4 },
    y: { domain: [0, length], label: "↓ query", ticks: 4, reverse: true },
    // Each head on its own scale, from its most negative bias to 0 (white): alibi's slopes
    // differ by powers of two, and one shared scale would leave the gentle heads blank.
    color: { type: "linear", scheme: "Purples", reverse: true, domain: [d3.min(cells, (d) => d.value), Math.max(0, d3.max(cells, (d) => d.value))], legend: true, label: "bias", width: size },
    marks: [Plot.raster(cells, { x: (d) => d.k + 0.5, y: (d) => d.q + 0.5, fill: "value", width: length, height: length, interpolate: "none", imageRendering: "pixelated" })],
  });
}
