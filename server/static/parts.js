// The Inside view's panel 4, position against content: the chosen head's scores from the last
// token (POST /v1/trace with score_parts), key by key against distance, each split into what
// the tokens are and where they are; for rope, each rotation pair's share as a pair × distance
// map. The split and its note are the server's: this draws them.
/* global d3, Plot */

import { post } from "./api.js";
import { signedScale } from "./colour.js";
import { interventions } from "./controls.js";
import { $, note, room, showError, visible } from "./dom.js";
import { plot } from "./plot.js";
import { model, state } from "./state.js";

// A trace asking for one more field (score_parts, attribution) and no attention, cached by its
// request: switching back to a head costs nothing.
export function extraTrace(extra) {
  const body = { model: model(), prompt: $("prompt").value, ...interventions(), attention: false, top: 1, ...extra };
  const key = JSON.stringify(body);
  if (!state.parts.has(key)) {
    if (state.parts.size > 32) state.parts.clear();
    state.parts.set(key, post("/v1/trace", body).catch((error) => { state.parts.delete(key); throw error; }));
  }
  return { key, trace: state.parts.get(key) };
}

// Each part's colour: content as panel 2's token embedding, position as its positional vector,
// and an additive scheme's three position terms in shades beside it.
const PARTS = {
  content: "#3b5bdb",
  position: "#c2410c",
  "token·token": "#3b5bdb",
  "token·position": "#f08c00",
  "position·token": "#d6336c",
  "position·position": "#862e9c",
  "score (not split here)": "#868e96",
};
const TERMS = {
  token_token: "token·token", token_position: "token·position",
  position_token: "position·token", position_position: "position·position",
};

let timer = null;
export function scheduleParts() {
  clearTimeout(timer);
  timer = setTimeout(drawParts, 80);
}

export async function drawParts() {
  const layer = Number($("layer").value);
  const head = Number($("head").value);
  const { key, trace } = extraTrace({ score_parts: { layer, head } });
  const target = $("parts-chart");
  target.dataset.key = key;
  try {
    const answer = await trace;
    if (target.dataset.key !== key) return; // a later head is drawing
    const split = answer.score_parts;
    const labels = answer.tokens.map((t) => visible(t.text));
    const space = room($("parts-panel"), 30, 1100); // drawn to fit, never shrunk: text stays readable
    target.replaceChildren(fit(partsChart(split, labels, Math.min(540, space)), Math.min(540, space)));
    $("frequency-chart").replaceChildren(split.frequencies ? fit(frequencyChart(split, Math.min(440, space)), Math.min(440, space)) : note(split.note));
    $("parts-readout").textContent = describe(split, labels);
    target.dataset.kind = split.kind;
    target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);
  } catch (error) {
    if (target.dataset.key !== key) return;
    target.replaceChildren();
    $("frequency-chart").replaceChildren();
    $("parts-readout").textContent = "";
    showError(target, error);
  }
}

// A chart no wider than it was drawn (its title would otherwise widen it), so two fit side by side.
function fit(figure, width) {
  figure.style.maxWidth = `${width}px`;
  return figure;
}

// The keys that have a score: a scheme may mask some (irope's window: null).
const scored = (split) => d3.range(split.score.length).filter((key) => split.score[key] !== null);

// Each key's parts, as rows {key, distance, part, value}: the four terms of an additive scheme at
// layer 0, else content and position, else the score alone (a deeper layer of an additive one).
function partsOf(split) {
  const keys = scored(split);
  const named = split.terms
    ? Object.entries(TERMS).map(([field, part]) => [part, split.terms[field]])
    : split.content
      ? [["content", split.content], ["position", split.position]]
      : [["score (not split here)", split.score]];
  return named.flatMap(([part, values]) => keys.map((key) => ({ key, distance: split.distance[key], part, value: values[key] })));
}

// Stacked bars of the parts (those above 0 up, those below down) and a dot at each key's score,
// their sum, against distance back from the last token.
function partsChart(split, labels, width) {
  const rows = partsOf(split);
  const length = split.score.length;
  const scores = scored(split).map((key) => ({ key, distance: split.distance[key], score: split.score[key] }));
  const tip = (d) => `key “${labels[d.key]}” (${d.key}), ${d.distance} back: ${d.part} ${d.value.toFixed(3)} of ${split.score[d.key].toFixed(3)}`;
  const parts = [...new Set(rows.map((d) => d.part))];
  const from = split.terms || !split.content ? null : positionWins(split).from;
  return plot({
    title: `layer ${split.layer}, head ${split.head}: each key's score from the last token “${labels[split.query]}”, in parts (the dot: their sum)`,
    width, height: 300, marginLeft: 48,
    // a bar spans [d, d + 1]: each tick at its middle
    x: { label: "distance back from the last token →", domain: [0, length], ticks: d3.ticks(0, length - 1, width / 60).filter(Number.isInteger).map((d) => d + 0.5), tickFormat: (x) => x - 0.5 },
    y: { label: "score (before the softmax)", grid: true },
    color: { legend: true, domain: parts, range: parts.map((part) => PARTS[part]) },
    marks: [
      Plot.rectY(rows, { x: "distance", interval: 1, y: "value", fill: "part", insetLeft: length <= 64 ? 0.5 : 0, insetRight: length <= 64 ? 0.5 : 0, title: tip }),
      Plot.ruleY([0], { stroke: "#111" }),
      Plot.ruleX(from === null ? [] : [from], { stroke: "#111", strokeDasharray: "4,3" }),
      Plot.text(from === null ? [] : [from], {
        x: (d) => d, frameAnchor: "top", dx: 4, textAnchor: "start", text: (d) => `position wins from ${d} back →`,
      }),
      Plot.dot(scores, {
        x: (d) => d.distance + 0.5, y: "score", fill: "#111", r: length <= 64 ? 3 : 1.5,
        title: (d) => `key “${labels[d.key]}” (${d.key}), ${d.distance} back: score ${d.score.toFixed(3)}`,
      }),
    ],
  });
}

// rope: each rotation pair's share of each key's score (they sum to it), fast pairs on top.
function frequencyChart(split, width) {
  const keys = scored(split);
  const cells = split.frequencies.flatMap((row, pair) => keys.map((key) => ({ pair, distance: split.distance[key], value: row[key] })));
  const extent = d3.quantile(cells, 0.99, (d) => Math.abs(d.value)) || 1;
  const length = split.score.length;
  const every = length <= 24 ? 2 : length <= 64 ? 8 : 32;
  const rate = d3.format(".2~g");
  return plot({
    title: "each rotation pair's share of the score (a column adds up to that distance's dot)",
    width, height: 300, marginLeft: 80, padding: 0,
    x: { type: "band", domain: d3.range(length), label: "distance back →", tickFormat: (d) => (d % every === 0 ? d : "") },
    y: {
      type: "band", domain: d3.range(split.frequencies.length), label: "↓ pair (radians per position)",
      tickFormat: (pair) => `${pair}: ${rate(split.frequency[pair])}`,
    },
    color: signedScale(extent, "share of the score"),
    marks: [Plot.cell(cells, {
      x: "distance", y: "pair", fill: "value", inset: 0,
      title: (d) => `pair ${d.pair} (${rate(split.frequency[d.pair])} rad per position), ${d.distance} back: ${d.value.toFixed(3)}`,
    })],
  });
}

// At how many keys position is the larger part, and from which distance on it is at every key
// (null where content wins the farthest key).
function positionWins(split) {
  const keys = scored(split);
  const wins = keys.filter((key) => Math.abs(split.position[key]) > Math.abs(split.content[key]));
  const lost = keys.filter((key) => !wins.includes(key));
  const last = d3.max(lost, (key) => split.distance[key]) ?? 0; // content's farthest win
  const farthest = d3.max(keys, (key) => split.distance[key]);
  return { count: wins.length, from: last < farthest ? Math.max(1, last + 1) : null };
}

// What a learner should read off: the key the head scores highest and what made it, and from
// which distance on position outweighs content; and the server's note, where the map took its
// place.
function describe(split, labels) {
  const top = d3.maxIndex(split.score);
  const sign = d3.format("+.2f");
  let text = `Highest score: “${labels[top]}”, ${split.distance[top]} back (${split.score[top].toFixed(2)}`;
  if (split.terms) {
    text += `: ${Object.entries(TERMS).map(([field, part]) => `${part} ${sign(split.terms[field][top])}`).join(", ")}).`;
  } else if (split.content) {
    text += `: content ${sign(split.content[top])}, position ${sign(split.position[top])}).`;
    const { count, from } = positionWins(split);
    text += ` Position outweighs content at ${count} of ${scored(split).length} keys` +
      (from === null ? "." : `, and at every key from ${from} back.`);
  } else {
    text += ").";
  }
  if (split.frequencies) {
    const shares = split.frequencies.map((row, pair) => ({ pair, value: row[top] }));
    const biggest = d3.sort(shares, (d) => -Math.abs(d.value)).slice(0, 3);
    text += ` Its largest shares: ${biggest.map((d) => `pair ${d.pair} (${d3.format(".2~g")(split.frequency[d.pair])} rad) ${sign(d.value)}`).join(", ")}.`;
  }
  return split.frequencies ? `${text} ${split.note}` : text;
}
