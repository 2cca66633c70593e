// The Inside view's experiments: the controls that change the forward pass (the position
// offset, a layer's positional signal dropped, heads ablated), the presets, and what moved.
// Each scheme's claim, what the experiments should show, is the server's (/v1/models).
/* global d3 */

import { interventions, showSliderValues } from "./controls.js";
import { $, checkbox, visible } from "./dom.js";
import { LONG_PASSAGE } from "./passage.js";
import { claimOf } from "./schemes.js";
import { modelInfo, state } from "./state.js";
import { restoreExperiment } from "./url.js";

// Total variation between two next-token distributions (the "logits" stage, every token).
function totalVariation(a, b) {
  const p = new Map(a.next_token.stages[0].top.map((e) => [e.id, e.prob]));
  const q = new Map(b.next_token.stages[0].top.map((e) => [e.id, e.prob]));
  let sum = 0;
  for (const id of new Set([...p.keys(), ...q.keys()])) sum += Math.abs((p.get(id) ?? 0) - (q.get(id) ?? 0));
  return sum / 2;
}

// The mean total variation of attention rows, over every layer, head and query.
function attentionChange(a, b) {
  if (!a || !b || a.data.length !== b.data.length) return null;
  let sum = 0;
  for (let i = 0; i < a.data.length; i++) sum += Math.abs(a.data[i] - b.data[i]);
  return sum / 255 / 2 / (a.layers * a.heads * a.length);
}

export function drawEffect(trace, baseline, experiment) {
  $("prediction").textContent = claimOf(trace.model);
  const target = $("offset-effect");
  if (!experiment) {
    target.textContent = "No experiment on: move the offset, or tick a layer or a head.";
    target.dataset.tv = "0";
    return;
  }
  const tv = totalVariation(trace, baseline);
  const change = attentionChange(state.lastTrace.attention, state.baseAttention);
  const top = (t) => t.next_token.stages[0].top[0];
  target.dataset.tv = String(tv);
  target.textContent = `Next token: total variation ${tv.toFixed(4)} from the unchanged pass (0 = the same distribution, 1 = disjoint); top token “${visible(top(baseline).text)}” ${top(baseline).prob.toFixed(3)} → “${visible(top(trace).text)}” ${top(trace).prob.toFixed(3)}.` +
    (change === null ? "" : ` Attention rows: mean total variation ${change.toFixed(4)}.`);
}

// The README's experiments, one click each, on a prompt whose next token is uncertain (the
// shipped models give its top token about 0.2), so that every change shows; panel 4's on a head
// that shows its scheme's claim (`layer`, `head`), some on a longer prompt.
const UNCERTAIN_PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou";
const LINES = LONG_PASSAGE.split("\n");
const PRESETS = {
  "offset-learned": { model: "learned", offset: 20 },
  "offset-rope": { model: "rope", offset: 20 },
  "drop-alibi": { model: "alibi", drop: "all" },
  lens: { model: "rope", lens: true },
  filters: { model: "rope", settings: { temperature: 1, top_k: 5, top_p: 0.5, min_p: 0, repetition_penalty: 1 } },
  "parts-alibi": { model: "alibi", prompt: LINES.slice(0, 9).join("\n"), layer: 3, head: 2 }, // 119 tokens
  "parts-rope": { model: "rope", layer: 1, head: 1 },
  "parts-learned": { model: "learned", layer: 0, head: 1 },
  "ablate-rope": { model: "rope", ablate: ["3.3"] }, // its probability of " not" more than doubles
};

// Sets the controls to preset `name`; false when its model is not served (nothing changes).
export function setPreset(name) {
  const preset = PRESETS[name];
  if (!modelInfo(preset.model)) return false;
  $("model").value = preset.model;
  $("model").dispatchEvent(new Event("change"));
  $("prompt").value = preset.prompt ?? UNCERTAIN_PROMPT;
  $("offset").value = String(preset.offset ?? 0);
  $("offset-value").textContent = $("offset").value;
  $("lens").checked = Boolean(preset.lens);
  for (const [id, value] of Object.entries(preset.settings ?? {})) $(id).value = String(value);
  showSliderValues();
  state.pending = {
    drop: preset.drop === "all" ? ["0", "1", "2", "3", "4", "5", "6", "7"] : [], ablate: preset.ablate ?? [],
    layer: preset.layer ?? null, head: preset.head ?? null,
  };
  restoreExperiment();
  return true;
}

// A box per layer (drop its positional signal) and per head (ablate it), made again when the
// traced model's shape changes. Returns whether the URL's or a preset's boxes, which did not
// exist before this trace, changed the experiment (then the caller traces again).
export function fillExperimentControls(trace) {
  const drop = $("drop");
  if (drop.dataset.layers !== String(trace.n_layers)) {
    const keep = drop.querySelector("legend");
    drop.replaceChildren(keep, ...d3.range(trace.n_layers).map((layer) => checkbox(`${layer}`, { layer })));
    const all = checkbox("all", {});
    all.querySelector("input").id = "drop-all";
    all.querySelector("input").addEventListener("change", (event) => {
      for (const box of drop.querySelectorAll("input[data-layer]")) box.checked = event.target.checked;
    });
    drop.append(all);
    drop.dataset.layers = String(trace.n_layers);
  }
  const ablate = $("ablate");
  const shape = `${trace.n_layers}×${trace.n_heads}`;
  if (ablate.dataset.shape !== shape) {
    const keep = ablate.querySelector("legend");
    const rows = d3.range(trace.n_layers).map((layer) => {
      const row = document.createElement("div");
      row.className = "ablate-row";
      row.append(`L${layer}`, ...d3.range(trace.n_heads).map((head) => checkbox(`h${head}`, { layer, head }, `layer ${layer} head ${head}`)));
      return row;
    });
    ablate.replaceChildren(keep, ...rows);
    ablate.dataset.shape = shape;
  }
  const traced = JSON.stringify(interventions());
  restoreExperiment();
  return JSON.stringify(interventions()) !== traced;
}
