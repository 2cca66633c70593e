// Colours: d3 scales, the same ones the legends show, each readable under every common colour
// blindness.
/* global d3 */

// Probability: cividis (dark blue → yellow); light enough behind text at this opacity.
export const probColour = (p) => {
  const colour = d3.color(d3.interpolateCividis(p));
  colour.opacity = 0.45;
  return colour.formatRgb();
};

export const SURPRISAL_MAX = 14; // bits
export const surprisalColour = (bits) => {
  const colour = d3.color(d3.interpolateViridis(1 - Math.min(bits, SURPRISAL_MAX) / SURPRISAL_MAX));
  colour.opacity = 0.35; // light enough that dark text keeps a 4.5:1 contrast on every shade
  return colour.formatRgb();
};

// Attention weights: cividis as 256 RGBA entries (one per uint8 level), level 0 white.
export const ATTENTION_COLOURS = (() => {
  const table = new Uint8ClampedArray(256 * 4);
  for (let level = 0; level < 256; level++) {
    const colour = level === 0 ? d3.rgb(255, 255, 255) : d3.rgb(d3.interpolateCividis(1 - Math.sqrt(level / 255)));
    table.set([colour.r, colour.g, colour.b, 255], level * 4);
  }
  return table;
})();
