// The Encodings view's measured half: what `ordinal geometry` wrote for a corpus (GET
// /v1/geometry/{corpus}: the committed report.json and its figures, unchanged), the traced
// model's rows highlighted among every scheme's.
/* global d3, Plot */

import { $ } from "./dom.js";
import { plot } from "./plot.js";

const REQUIREMENT_COLUMNS = [
  ["bounded", "bounded_growth", "bounded (growth 4n/n)"],
  ["unique", "min_separation", "unique (min separation)"],
  ["length_independent", "length_drift", "length-independent (drift)"],
  ["smooth", "smoothness", "smooth (max step / median)"],
  ["relative_recoverable", "relative_error", "relative recoverable (error)"],
  ["beyond_max_positions", null, "past max_positions"],
];
const DIAGNOSTICS = [
  ["stress", "stress"],
  ["scale_free_stress", "stress after the best rescaling"],
  ["monotonicity_violation_rate", "monotonicity violations"],
  ["min_separation", "min separation"],
];
const FIGURE_CAPTIONS = {
  "hellinger.png": "Hellinger distance between the token distributions at each pair of positions",
  "eigenspectrum.png": "eigenvalues of the MDS Gram matrix: how many dimensions position needs",
  "mds_scatter.png": "the positions in the top two MDS coordinates",
  "stress.png": "stress of every scheme against the corpus geometry",
  "dot_products.png": "mean PE_i·PE_i+k against the offset, per scheme",
  "requirements.png": "the five requirements, measured, per scheme",
};

const formatNumber = (value) => (value === null || value === undefined ? "n/a" : typeof value === "number" ? d3.format(".3~g")(value) : String(value));
const verdict = (value) => (value === true ? "yes" : value === false ? "no" : "n/a");

// The report's rows for the traced model: the checkpoint's own row ("prope (rope)" for prope,
// rope's for rope+yarn4) where the report has one, else every row of its scheme (drope: none).
function reportRowsFor(report, trace) {
  const checkpoint = trace.model.split("+")[0];
  const own = report.schemes.filter((entry) => entry.label.startsWith(`${checkpoint} (`));
  const rows = own.length ? own : report.schemes.filter((entry) => entry.scheme === trace.scheme);
  return new Set(rows.map((entry) => entry.label));
}

export function drawReport(report, trace) {
  const corpus = report.corpus;
  const chosen = reportRowsFor(report, trace);
  $("report-what").textContent = `corpus ${corpus.name}: ${corpus.n_sequences.toLocaleString()} sequences, ${corpus.n_positions} positions — ${report.schemes.some((s) => s.label.includes("(")) ? "the shipped checkpoints" : "every scheme untrained"}`;
  $("profile-chart").replaceChildren(profileChart(report, chosen, trace.scheme));
  $("diagnostics").replaceChildren(diagnosticsTable(report.schemes.find((entry) => chosen.has(entry.label)), trace.scheme));
  $("requirements-table").replaceChildren(requirementsTable(report, chosen));
  $("figures").replaceChildren(...report.figures.map((figure) => figureOf(corpus.name, figure)));
}

// Dot product vs offset, as measured: every scheme, the chosen one drawn over the rest.
function profileChart(report, chosen, scheme) {
  const lines = report.schemes.flatMap((entry) => (entry.dot_product_by_offset ?? [])
    .map((value, offset) => ({ offset, value, label: entry.label, chosen: chosen.has(entry.label) }))
    .filter((d) => d.value !== null));
  return plot({
    title: `measured: mean PE_i·PE_i+k / mean ‖PE_i‖² (${scheme} in colour)`,
    width: 460, height: 300, marginLeft: 44,
    x: { label: "offset k →" }, y: { label: "dot product", grid: true },
    marks: [
      Plot.ruleY([0]),
      Plot.lineY(lines.filter((d) => !d.chosen), { x: "offset", y: "value", z: "label", stroke: "#ccc", strokeWidth: 1 }),
      Plot.lineY(lines.filter((d) => d.chosen), { x: "offset", y: "value", stroke: "#e8590c", strokeWidth: 2.5, tip: true }),
    ],
  });
}

// The chosen row's distance from the corpus geometry.
function diagnosticsTable(own, scheme) {
  const diagnostics = document.createElement("table");
  diagnostics.className = "measured";
  diagnostics.innerHTML = "<caption></caption><tbody></tbody>";
  diagnostics.caption.textContent = own ? `${own.label} against the corpus geometry` : `no ${scheme} in this report`;
  for (const [key, label] of own ? DIAGNOSTICS : []) {
    const row = diagnostics.tBodies[0].insertRow();
    row.insertCell().textContent = label;
    row.insertCell().textContent = own.error ? own.error : formatNumber(own[key]);
  }
  return diagnostics;
}

// The five requirements, measured: every scheme, the chosen one highlighted.
function requirementsTable(report, chosen) {
  const table = document.createElement("table");
  table.className = "requirements";
  const head = table.createTHead().insertRow();
  for (const label of ["encoding", ...REQUIREMENT_COLUMNS.map(([, , text]) => text)]) {
    const cell = document.createElement("th");
    cell.textContent = label;
    head.append(cell);
  }
  const body = table.createTBody();
  for (const entry of report.requirements) {
    const row = body.insertRow();
    row.classList.toggle("chosen", chosen.has(entry.label));
    row.dataset.scheme = entry.scheme;
    row.insertCell().textContent = entry.label;
    for (const [flag, measure] of REQUIREMENT_COLUMNS) {
      const cell = row.insertCell();
      cell.className = `verdict-${verdict(entry[flag]).replace("/", "")}`;
      cell.textContent = verdict(entry[flag]) + (measure ? ` (${formatNumber(entry[measure])})` : "");
    }
  }
  return table;
}

function figureOf(corpus, figure) {
  const element = document.createElement("figure");
  const image = new Image();
  image.src = `/v1/geometry/${encodeURIComponent(corpus)}/${encodeURIComponent(figure)}`;
  image.alt = FIGURE_CAPTIONS[figure] ?? figure;
  image.loading = "lazy";
  const caption = document.createElement("figcaption");
  caption.textContent = FIGURE_CAPTIONS[figure] ?? figure;
  element.append(image, caption);
  return element;
}
