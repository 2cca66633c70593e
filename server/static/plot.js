// Observable Plot (vendored, a global), made accessible: every chart of the page but the
// canvas heatmaps is drawn through here.
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
