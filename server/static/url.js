// The URL: view, models, prompt, settings and experiment, so that reload keeps them, Back and
// Forward move between views, and a link reproduces the view.

import { $ } from "./dom.js";
import { SLIDERS, comparedModels, interventions, showSliderValues } from "./controls.js";
import { model, modelInfo, state } from "./state.js";

const URL_INPUTS = ["prompt", ...SLIDERS, "max_tokens", "seed", "offset"];
export const VIEWS = ["generate", "compare", "inside", "encodings"];

function currentParams() {
  const params = new URLSearchParams();
  params.set("view", state.view);
  params.set("model", model());
  if (state.view === "compare") params.set("models", comparedModels().join(","));
  if (state.view === "encodings" && $("corpus").value) params.set("corpus", $("corpus").value);
  for (const id of URL_INPUTS) if ($(id).value !== $(id).defaultValue) params.set(id, $(id).value);
  if (state.view === "inside") {
    const changes = interventions();
    if (changes.drop_positional) params.set("drop", changes.drop_positional.join(","));
    if (changes.ablate) params.set("ablate", changes.ablate.map((a) => `${a.layer}.${a.head}`).join(","));
    if ($("lens").checked) params.set("lens", "1");
    params.set("layer", $("layer").value || "0");
    params.set("head", $("head").value || "0");
  }
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
  if (params.has("models")) {
    const names = params.get("models").split(",");
    for (const box of document.querySelectorAll("#compare-models input")) box.checked = names.includes(box.value);
  }
  if (params.has("corpus")) $("corpus").value = params.get("corpus");
  $("lens").checked = params.get("lens") === "1";
  state.pending = {
    drop: (params.get("drop") ?? "").split(",").filter(Boolean),
    ablate: (params.get("ablate") ?? "").split(",").filter(Boolean),
    layer: params.get("layer"),
    head: params.get("head"),
  };
  restoreExperiment();
  showSliderValues();
  $("offset-value").textContent = $("offset").value;
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
