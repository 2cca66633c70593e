// The sampling stages: the next token's distribution after each stage of the sampler, in its
// order (Generate's alternatives and Inside's panel 4).
/* global Plot */

import { visible } from "./dom.js";
import { plot } from "./plot.js";

// One row per (stage, shown token): the top 10 before and after the filters, and `chosen`.
function stageRows(stages, chosen) {
  const shown = new Map(); // id → text, the tokens on the y axis
  for (const entry of stages[0].top.slice(0, 10)) shown.set(entry.id, entry.text);
  for (const entry of stages.at(-1).top.slice(0, 10)) shown.set(entry.id, entry.text);
  if (chosen !== null && !shown.has(chosen)) {
    const found = stages.flatMap((s) => s.top).find((entry) => entry.id === chosen);
    if (found) shown.set(chosen, found.text);
  }
  const rows = [];
  for (const stage of stages) {
    const probs = new Map(stage.top.map((entry) => [entry.id, entry.prob]));
    for (const [id, text] of shown) {
      rows.push({
        stage: `${stage.name} (${stage.kept} kept)`,
        token: `${visible(text)} ·${id}`,
        prob: probs.get(id) ?? 0,
        chosen: id === chosen,
        dropped: !probs.has(id), // a filter of this stage (or an earlier one) removed it
      });
    }
  }
  return { rows, order: [...shown].map(([id, text]) => `${visible(text)} ·${id}`) };
}

const STAGE_WIDTH = 150; // the least a stage's bars need beside the others

// Bars of the next-token distribution, one small multiple per sampling stage: side by side where
// `width` (the container's, px) holds them, else one above the next at that width, so that a
// phone shows them at the size of their text instead of shrinking four into its screen.
export function stagesChart(trace, chosen = null, width = Infinity) {
  const stages = trace.next_token.stages;
  const { rows, order } = stageRows(stages, chosen);
  const names = stages.map((s) => `${s.name} (${s.kept} kept)`);
  const options = (height) => ({
    height,
    marginLeft: 90,
    marginTop: 24,
    style: { fontSize: "11px" },
    x: { domain: [0, 1], ticks: [0, 0.5], label: "probability", grid: true },
    y: { domain: order, label: null },
    color: { domain: [false, true], range: ["#748ffc", "#e8590c"] },
  });
  const marks = (data, facet) => [
    Plot.barX(data, { ...facet, y: "token", x: "prob", fill: "chosen", tip: true }),
    Plot.text(data, {
      ...facet, y: "token", x: "prob", text: (d) => (d.dropped ? "✕ dropped" : d.prob >= 0.005 ? d.prob.toFixed(2) : ""),
      dx: 3, textAnchor: "start", fontSize: 9, fill: (d) => (d.dropped ? "#b42318" : "currentColor"),
    }),
    Plot.ruleX([0]),
  ];
  if (!(width > 0) || width >= STAGE_WIDTH * stages.length) { // 0: drawn while hidden
    return plot({
      ...options(28 + 19 * order.length),
      width: Math.max(620, STAGE_WIDTH * stages.length),
      fx: { domain: names, label: null, padding: 0.12 },
      marks: marks(rows, { fx: "stage" }),
    });
  }
  const column = document.createElement("div");
  column.className = "stage-column";
  for (const name of names) {
    const caption = document.createElement("p");
    caption.className = "stage-name";
    caption.textContent = name;
    const stageRowsOnly = rows.filter((row) => row.stage === name);
    column.append(caption, plot({ ...options(38 + 19 * order.length), marginTop: 8, width, marks: marks(stageRowsOnly, {}) }));
  }
  return column;
}
