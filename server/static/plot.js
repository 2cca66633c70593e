// Observable Plot (vendored, a global), made accessible: every chart of the page but the
// canvas heatmaps is drawn through here, and the surprisal curves that Compare and Length share.
/* global Plot */

import { $ } from "./dom.js";

// Plot names its mark groups with aria-label on plain <g> elements, which ARIA permits only on
// elements with a role: they are groups.
export function accessible(node) {
  for (const group of node.querySelectorAll("g[aria-label]:not([role])")) group.setAttribute("role", "group");
  return node;
}

export const plot = (options) => accessible(Plot.plot(options));

export function legend(target, options) {
  const node = accessible(Plot.legend({ width: 220, ...options }));
  // Only the colour ramp is faded (as the tokens are); the text keeps its contrast.
  for (const ramp of node.querySelectorAll("image, rect")) ramp.style.opacity = options.opacity ?? 1;
  $(target).replaceChildren(node);
}

// The mean of the last `window` values at each index (fewer at the start).
export function movingMean(values, window) {
  let sum = 0;
  return values.map((value, i) => {
    sum += value - (i >= window ? values[i - window] : 0);
    return sum / Math.min(i + 1, window);
  });
}

// Surprisal by position, a line per model, smoothed by a moving mean, with each training length
// dashed: `series` [{model, bits: bits per position from 1, trained}], `models` the colour order.
export function surprisalCurves(series, models, { window = 16, width = 900, height = 220 } = {}) {
  const points = series.flatMap(({ model, bits }) => movingMean(bits, window).map((value, i) => ({
    model, position: i + 1, bits: value,
  })));
  const trained = [...new Set(series.map((s) => s.trained))];
  return plot({
    width, height, marginLeft: 40,
    x: { label: "position →" }, y: { label: `bits (mean of the last ${window})`, grid: true, zero: true },
    color: { legend: true, scheme: "observable10", domain: models },
    marks: [
      Plot.lineY(points, { x: "position", y: "bits", stroke: "model", tip: true }),
      Plot.ruleX(trained, { stroke: "#555", strokeDasharray: "3,3" }),
      Plot.text(trained, { x: (d) => d, frameAnchor: "top", dy: 4, dx: 4, textAnchor: "start", text: (d) => `trained length ${d}` }),
    ],
  });
}
