// The Inside view's panel 6, where the logit comes from: the next token's logit for a target,
// split into what each part of the model wrote into the residual stream (POST /v1/trace with
// attribution): the embedding, the positional vector, every head, every MLP. The server's
// parts sum to the logit; this draws them, grouped by layer.
/* global d3, Plot */

import { NEGATIVE, POSITIVE } from "./colour.js";
import { $, fixed, room, showError, visible } from "./dom.js";
import { extraTrace } from "./parts.js";
import { plot } from "./plot.js";

export async function drawAttribution() {
  const chosen = $("target").value;
  const { key, trace } = extraTrace({ attribution: true, ...(chosen ? { target: Number(chosen) } : {}) });
  const target = $("attribution-chart");
  target.dataset.key = key;
  try {
    const answer = await trace;
    if (target.dataset.key !== key) return; // a later target is drawing
    const { token, logit, parts } = answer.attribution;
    target.replaceChildren(partsChart(answer.attribution, Math.min(600, room($("attribution-panel"), 30, 1100))));
    const sum = d3.sum(parts, (part) => part.value);
    const up = d3.greatest(parts, (part) => part.value);
    const down = d3.least(parts, (part) => part.value);
    const sign = d3.format("+.2f");
    $("attribution-readout").textContent = `Target “${visible(token.text)}” (token ${token.id}): logit ${logit.toFixed(2)}, ` +
      `the sum of the ${parts.length} bars (${sum.toFixed(2)}). Pushed it up most: ${up.name} ${sign(up.value)}; ` +
      `down most: ${down.name} ${sign(down.value)}.`;
    target.dataset.logit = String(logit);
    target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);
  } catch (error) {
    if (target.dataset.key !== key) return;
    target.replaceChildren();
    $("attribution-readout").textContent = "";
    showError(target, error);
  }
}

// A bar per part in the server's order (the inputs, then each layer's heads and MLP), every
// other layer on a grey band; right of 0 pushes the target up, left pushes it down.
function partsChart({ token, logit, parts }, width) {
  const names = parts.map((part) => part.name);
  const extent = d3.max(parts, (part) => Math.abs(part.value)) || 1;
  const banded = parts.filter((part) => part.layer !== null && part.layer % 2 === 1);
  return plot({
    title: `“${visible(token.text)}”: logit ${logit.toFixed(2)}, part by part`,
    width, height: 40 + 17 * parts.length, marginLeft: 70, marginRight: 10,
    x: { label: "adds to the logit →", domain: [-extent * 1.15, extent * 1.15], grid: true },
    y: { domain: names, label: null },
    marks: [
      Plot.barX(banded, { y: "name", x1: -extent * 1.15, x2: extent * 1.15, fill: "#f1f3f5", insetTop: -1, insetBottom: -1 }),
      Plot.barX(parts, {
        y: "name", x: "value", fill: (part) => (part.value >= 0 ? POSITIVE : NEGATIVE),
        title: (part) => `${part.name}: ${part.value.toFixed(3)}`,
      }),
      Plot.ruleX([0], { stroke: "#111" }),
      Plot.text(parts, {
        y: "name", x: "value", text: (part) => fixed(part.value), fill: "#1d1d1f",
        textAnchor: "start", dx: 4, filter: (part) => part.value >= 0,
      }),
      Plot.text(parts, {
        y: "name", x: "value", text: (part) => fixed(part.value), fill: "#1d1d1f",
        textAnchor: "end", dx: -4, filter: (part) => part.value < 0,
      }),
    ],
  });
}
