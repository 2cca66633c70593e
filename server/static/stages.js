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

// Bars of the next-token distribution, one small multiple per sampling stage.
export function stagesChart(trace, chosen = null) {
  const stages = trace.next_token.stages;
  const { rows, order } = stageRows(stages, chosen);
  return plot({
    width: Math.max(620, 150 * stages.length),
    height: 28 + 19 * order.length,
    marginLeft: 90,
    marginTop: 24,
    style: { fontSize: "11px" },
    fx: { domain: stages.map((s) => `${s.name} (${s.kept} kept)`), label: null, padding: 0.12 },
    x: { domain: [0, 1], ticks: [0, 0.5], label: "probability", grid: true },
    y: { domain: order, label: null },
    color: { domain: [false, true], range: ["#748ffc", "#e8590c"] },
    marks: [
      Plot.barX(rows, { fx: "stage", y: "token", x: "prob", fill: "chosen", tip: true }),
      Plot.text(rows, {
        fx: "stage", y: "token", x: "prob", text: (d) => (d.dropped ? "✕ dropped" : d.prob >= 0.005 ? d.prob.toFixed(2) : ""),
        dx: 3, textAnchor: "start", fontSize: 9, fill: (d) => (d.dropped ? "#b42318" : "currentColor"),
      }),
      Plot.ruleX([0]),
    ],
  });
}
