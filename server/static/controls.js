// The controls, read: the sampling sliders and their readouts, the compared models, the
// experiment's interventions, and the prompt presets of the settings panel.

import { $ } from "./dom.js";
import { LONG_PASSAGE } from "./passage.js";

export const SLIDERS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty"];
export const COMPARE_DEFAULT = ["rope", "alibi", "none"];
// A prompt longer than the shipped models' 128-token training context (the settings' preset):
// the long passage's first 23 lines, about 300 tokens.
export const LONG_PROMPT = LONG_PASSAGE.split("\n").slice(0, 23).join("\n");

export function samplingSettings() {
  const value = (id) => Number($(id).value);
  return {
    temperature: value("temperature"),
    top_k: Math.round(value("top_k")),
    top_p: value("top_p"),
    min_p: value("min_p"),
    repetition_penalty: value("repetition_penalty"),
  };
}

export function showSliderValues() {
  for (const id of SLIDERS) {
    const input = $(id);
    const output = document.querySelector(`output[for="${id}"]`);
    let text = input.value;
    if (id === "top_k" && Number(input.value) === 0) text = "off";
    if (id === "top_p" && Number(input.value) === 1) text = "off";
    if (id === "min_p" && Number(input.value) === 0) text = "off";
    if (id === "repetition_penalty" && Number(input.value) === 1) text = "off";
    if (id === "temperature" && Number(input.value) === 0) text = "0 (greedy)";
    output.textContent = text;
  }
}

const formatCount = (n) => (n >= 1e6 ? `${(n / 1e6).toFixed(2)} M` : `${(n / 1e3).toFixed(1)} k`);

export function describeModel(entry) {
  const table = entry.max_positions ? `, table of ${entry.max_positions} positions` : "";
  return `scheme ${entry.scheme} · trained at ${entry.context_length} tokens${table} · serves up to ${entry.max_context} · ${formatCount(entry.parameters)} parameters`;
}

// The models ticked in a fieldset of model boxes (Compare's, Length's).
export const ticked = (id) => [...$(id).querySelectorAll("input:checked")].map((box) => box.value);

export const comparedModels = () => ticked("compare-models");

// The Inside view's experiment as /v1/trace's fields: the offset, the layers whose positional
// signal is dropped, the ablated heads (each left out when unset).
export function interventions() {
  const body = {};
  const offset = Number($("offset").value);
  if (offset) body.position_offset = offset;
  const dropped = [...document.querySelectorAll("#drop input[data-layer]:checked")].map((box) => Number(box.dataset.layer));
  if (dropped.length) body.drop_positional = dropped;
  const ablate = [...document.querySelectorAll("#ablate input:checked")].map((box) => ({ layer: Number(box.dataset.layer), head: Number(box.dataset.head) }));
  if (ablate.length) body.ablate = ablate;
  return body;
}

export function swapWordOrder() {
  const text = $("prompt").value.trim();
  const match = text.match(/^(.*?)([.!?]*)$/s);
  const words = match[1].split(/\s+/).reverse();
  const fix = (word, i) => (i === 0 ? word[0].toUpperCase() + word.slice(1) : word === "I" ? word : word.toLowerCase());
  $("prompt").value = words.map(fix).join(" ") + match[2];
}
