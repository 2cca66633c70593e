// What the page holds between events, in one place: every view reads and writes this bag (as
// Transformer Explainer's stores), and nothing else keeps state but the controls themselves.

import { $ } from "./dom.js";

export const state = {
  models: [], // entries of GET /v1/models (each with its scheme's kind and claim)
  view: "generate",
  generation: null, // {model, promptIds, ids, texts, settings, maxTokens, seed}
  abort: null, // AbortController of the running Generate or Compare
  lastTrace: null, // {key, trace, baseline, attention}: what the Inside view drew
  baseAttention: null, // the unchanged pass's attention, beside an experiment's
  traceTimer: null,
  reports: new Map(), // corpus → report.json of `ordinal geometry` (GET /v1/geometry/{corpus})
  positional: new Map(), // model → its trace without attention, over its training length
  traces: new Map(), // request JSON → promise of its trace (the baseline and experiment traces)
  pending: null, // settings from the URL not yet applied (the experiment's boxes come later)
  pendingTarget: null, // {view, id}: the URL's target, for the picker that the view fills later
  parts: new Map(), // trace request JSON → promise of a score split or an attribution
  surprisal: new Map(), // "model\ntext" → promise of its surprisal per position (Length)
  lengths: null, // the Length view's curves drawn last (redrawn when the smoothing moves)
};

// The model picked in the settings, and a model's entry of /v1/models.
export const model = () => $("model").value;
export const modelInfo = (name) => state.models.find((entry) => entry.id === name);

export function stopRunning() {
  if (state.abort) state.abort.abort();
  state.abort = null;
}
