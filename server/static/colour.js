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

// Signed values (a bias, a score's parts, an attribution, a patching effect): diverging around 0,
// purple above and orange below (PuOr, readable under colour blindness); as a d3 scale for canvas
// and table cells, and as the options of a Plot colour scale.
const signed = (t) => d3.interpolatePuOr(1 - t);
export const POSITIVE = signed(0.85);
export const NEGATIVE = signed(0.15);
export const signedColour = (extent) => d3.scaleDiverging(signed).domain([-extent, 0, extent]).clamp(true);
export const signedScale = (extent, label) => ({
  type: "diverging", interpolate: signed, domain: [-extent, extent], pivot: 0, clamp: true, label, legend: true,
});

// Black or white, whichever reads better on `background` (WCAG contrast: at least 4.5:1 always).
export function inkOn(background) {
  const channel = (value) => {
    const c = value / 255;
    return c <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
  };
  const { r, g, b } = d3.rgb(background);
  const luminance = 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b);
  return (luminance + 0.05) / 0.05 >= 1.05 / (luminance + 0.05) ? "#111" : "#fff";
}
