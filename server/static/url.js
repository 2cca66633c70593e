// The URL: view, models, prompt, settings and experiment, so that reload keeps them, Back and
// Forward move between views, and a link reproduces the view.

import { $, visible } from "./dom.js";
import { SLIDERS, interventions, showSliderValues, ticked } from "./controls.js";
import { model, modelInfo, state } from "./state.js";

const URL_INPUTS = ["prompt", ...SLIDERS, "max_tokens", "seed", "offset", "length-text", "smoothing", "clean", "corrupted"];
export const VIEWS = ["generate", "compare", "length", "inside", "patch", "encodings"];
const MODEL_BOXES = { compare: "compare-models", length: "length-models" }; // a view's model boxes

function currentParams() {
  const params = new URLSearchParams();
  params.set("view", state.view);
  params.set("model", model());
  if (MODEL_BOXES[state.view]) params.set("models", ticked(MODEL_BOXES[state.view]).join(","));
  if (state.view === "encodings" && $("corpus").value) params.set("corpus", $("corpus").value);
  for (const id of URL_INPUTS) if ($(id).value !== $(id).defaultValue) params.set(id, $(id).value);
  if (state.view === "inside") {
    const changes = interventions();
    if (changes.drop_positional) params.set("drop", changes.drop_positional.join(","));
    if (changes.ablate) params.set("ablate", changes.ablate.map((a) => `${a.layer}.${a.head}`).join(","));
    if ($("lens").checked) params.set("lens", "1");
    params.set("layer", $("layer").value || "0");
    params.set("head", $("head").value || "0");
    if ($("target").value) params.set("target", $("target").value);
  }
  if (state.view === "patch" && $("patch-target").value) params.set("target", $("patch-target").value);
  return params;
}

export function saveState(push = false) {
  if (document.body.dataset.ready !== "true") return;
  const url = `?${currentParams()}`;
  if (url === location.search) return;
  history[push ? "pushState" : "replaceState"](null, "", url);
}

// Applies the URL's settings to the controls; returns the view it names.
export function restoreState() {
  const params = new URLSearchParams(location.search);
  if (params.has("model") && modelInfo(params.get("model"))) $("model").value = params.get("model");
  for (const id of URL_INPUTS) $(id).value = params.has(id) ? params.get(id) : $(id).defaultValue;
  const boxes = MODEL_BOXES[params.get("view")];
  if (params.has("models") && boxes) {
    const names = params.get("models").split(",");
    for (const box of document.querySelectorAll(`#${boxes} input`)) box.checked = names.includes(box.value);
  }
  if (params.has("corpus")) $("corpus").value = params.get("corpus");
  $("lens").checked = params.get("lens") === "1";
  state.pending = {
    drop: (params.get("drop") ?? "").split(",").filter(Boolean),
    ablate: (params.get("ablate") ?? "").split(",").filter(Boolean),
    layer: params.get("layer"),
    head: params.get("head"),
  };
  // Inside's attribution target or Patch's, applied when that view fills its picker
  state.pendingTarget = params.has("target") ? { view: params.get("view"), id: params.get("target") } : null;
  if (params.get("view") === "patch") fillTargets($("patch-target"), [], "clean's most probable"); // before its first run
  restoreExperiment();
  showSliderValues();
  $("offset-value").textContent = $("offset").value;
  $("smoothing-value").textContent = $("smoothing").value;
  const view = params.get("view");
  return VIEWS.includes(view) ? view : "generate";
}

export function restoreExperiment() {
  const pending = state.pending;
  if (!pending) return;
  for (const box of document.querySelectorAll("#drop input[data-layer]")) box.checked = pending.drop.includes(box.dataset.layer);
  for (const box of document.querySelectorAll("#ablate input")) box.checked = pending.ablate.includes(`${box.dataset.layer}.${box.dataset.head}`);
}

export function restoreAttentionChoice() {
  const pending = state.pending;
  if (!pending) return;
  if (pending.layer !== null && pending.layer < $("layer").options.length) $("layer").value = pending.layer;
  if (pending.head !== null && pending.head < $("head").options.length) $("head").value = pending.head;
  state.pending = null; // both the boxes and the pickers exist now
}

// Fills a target picker (Inside's or Patch's) with `tokens` ({id, text}, most probable first)
// after `first` (the option of no value: the server's default), keeping the target chosen before
// (or the URL's) where it is not among them.
export function fillTargets(select, tokens, first) {
  const pending = state.pendingTarget;
  const view = select.id === "target" ? "inside" : "patch";
  const linked = pending && pending.view === view;
  if (linked) state.pendingTarget = null;
  const wanted = linked ? pending.id : select.value;
  const kept = select.selectedOptions[0]?.textContent;
  const options = [new Option(first, ""), ...tokens.map((t) => new Option(`“${visible(t.text)}” (${t.id})`, String(t.id)))];
  if (wanted && !tokens.some((t) => String(t.id) === wanted)) {
    options.push(new Option(!linked && kept ? kept : `token ${wanted}`, wanted));
  }
  select.replaceChildren(...options);
  select.value = wanted;
}
