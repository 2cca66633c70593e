// The ordinal playground's entry module: it loads the models, fills the pickers, wires every
// control to its view, and restores the view the URL names. Each view is a module of its own
// (generate.js, compare.js, length.js, inside.js, patch.js, encodings.js; length.js and patch.js
// wire their own controls), the state one bag (state.js); charts are
// Observable Plot marks on the d3 vendored beside them, except the attention and bias heatmaps,
// drawn to canvas (heatmap.js). No build step: the browser loads these files as they are.

import { call, get } from "./api.js";
import { drawAttribution } from "./attribution.js";
import { compare } from "./compare.js";
import { COMPARE_DEFAULT, LONG_PROMPT, SLIDERS, comparedModels, describeModel, showSliderValues, swapWordOrder } from "./controls.js";
import { $ } from "./dom.js";
import { drawEncodings } from "./encodings.js";
import { generate } from "./generate.js";
import { applyPreset, chooseHead, runTrace, scheduleStages, scheduleTrace } from "./inside.js";
import { drawLength, fillLengthModels, wireLength } from "./length.js";
import { runPatch, schedulePatch, wirePatch } from "./patch.js";
import { legend } from "./plot.js";
import { model, modelInfo, state, stopRunning } from "./state.js";
import { restoreState, saveState } from "./url.js";

function showView(view, push = true) {
  state.view = view;
  document.body.dataset.view = view;
  showModelInfo(); // the URL's model, or Back's
  for (const button of document.querySelectorAll("#tabs button")) {
    button.setAttribute("aria-selected", String(button.dataset.view === view));
  }
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${view}`;
  }
  if (view === "inside") runTrace();
  if (view === "encodings") drawEncodings();
  if (view === "length") drawLength();
  if (view === "patch") runPatch();
  saveState(push);
}

const showModelInfo = () => { $("model-info").textContent = describeModel(modelInfo(model())); };

// The model picker (the default model chosen, or the one picked before) and Compare's boxes
// (those ticked before, or the defaults), from /v1/models.
function fillModels(picked = null, ticked = null) {
  const select = $("model");
  select.replaceChildren(...state.models.map((entry) => new Option(`${entry.id} (${entry.scheme}, ctx ${entry.context_length})`, entry.id)));
  const kept = state.models.find((entry) => entry.id === picked);
  select.value = (kept ?? state.models.find((entry) => entry.default) ?? state.models[0]).id;
  showModelInfo();
  const boxes = $("compare-models");
  for (const label of boxes.querySelectorAll(":scope > label")) label.remove(); // not the legend
  for (const entry of state.models) {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.value = entry.id;
    box.checked = (ticked ?? COMPARE_DEFAULT).includes(entry.id);
    label.append(box, entry.id);
    boxes.append(label);
  }
  fillLengthModels(); // Length's boxes: those ticked before, or the defaults
  $("status").textContent = `${state.models.length} models loaded`;
  $("status").setAttribute("role", "status");
}

// The server loads, reloads and unloads checkpoints while it serves (its folder is watched):
// the pickers follow, looked at again when the model picker is opened and every REFRESH_MS
// while the page is shown.
const REFRESH_MS = 10000;
async function refreshModels() {
  if (document.visibilityState !== "visible") return;
  let models;
  try {
    const response = await call("/v1/models");
    if (!response.ok) return;
    models = (await response.json()).data;
  } catch {
    return; // the server is restarting or gone: the next look tries again
  }
  if (JSON.stringify(models) === JSON.stringify(state.models)) return;
  const ticked = comparedModels();
  state.models = models;
  fillModels(model(), ticked);
}

// The tabs, the settings panel and the experiment's controls; Back and Forward.
function wireSettings() {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.addEventListener("click", () => showView(button.dataset.view));
  }
  for (const id of SLIDERS) {
    $(id).addEventListener("input", () => {
      showSliderValues();
      if (state.view === "inside") scheduleStages(); // the stages only: attention is unchanged
      saveState();
    });
  }
  for (const id of ["max_tokens", "seed"]) $(id).addEventListener("input", () => saveState());
  $("compare-models").addEventListener("change", () => saveState());
  $("model").addEventListener("change", () => {
    showModelInfo();
    if (state.view === "inside") scheduleTrace();
    if (state.view === "encodings") drawEncodings();
    if (state.view === "patch") schedulePatch();
    saveState();
  });
  $("offset").addEventListener("input", () => {
    $("offset-value").textContent = $("offset").value;
    scheduleTrace();
  });
  for (const id of ["drop", "ablate"]) $(id).addEventListener("change", scheduleTrace);
  $("lens").addEventListener("change", scheduleTrace);
  $("settings-toggle").addEventListener("click", () => {
    const open = document.body.classList.toggle("settings-open");
    $("settings-toggle").setAttribute("aria-expanded", String(open));
  });
  window.addEventListener("popstate", () => showView(restoreState(), false));
}

// The geometry reports' picker (shakespeare's when there is one).
async function fillCorpora() {
  const reports = await get("/v1/geometry");
  $("corpus").replaceChildren(...reports.data.map((entry) => new Option(`${entry.corpus} (${entry.n_positions} positions)`, entry.corpus)));
  if (reports.data.some((entry) => entry.corpus === "shakespeare")) $("corpus").value = "shakespeare";
  $("corpus").addEventListener("change", drawEncodings);
}

// Each view's buttons and pickers, and the prompt presets.
function wireViews() {
  $("prompt").addEventListener("input", () => { if (state.view === "inside") scheduleTrace(); });
  $("generate").addEventListener("click", generate);
  $("stop").addEventListener("click", stopRunning);
  $("compare").addEventListener("click", compare);
  $("trace").addEventListener("click", runTrace);
  $("compare-stop").addEventListener("click", stopRunning);
  for (const button of document.querySelectorAll("#view-inside [data-preset]")) {
    button.addEventListener("click", () => applyPreset(button.dataset.preset));
  }
  for (const id of ["layer", "head"]) {
    $(id).addEventListener("change", () => chooseHead("attention"));
    $(`parts-${id}`).addEventListener("change", () => chooseHead("parts"));
  }
  $("target").addEventListener("change", () => { drawAttribution(); saveState(); });
  wireLength();
  wirePatch();
  $("swap-order").addEventListener("click", swapWordOrder);
  $("long-prompt").addEventListener("click", () => { $("prompt").value = LONG_PROMPT; });
  const boxes = $("compare-models");
  $("all-models").addEventListener("click", () => { for (const box of boxes.querySelectorAll("input")) box.checked = true; });
  $("no-models").addEventListener("click", () => { for (const box of boxes.querySelectorAll("input")) box.checked = false; });
}

async function start() {
  document.body.dataset.view = "generate";
  showSliderValues();
  legend("prob-legend", { color: { type: "linear", domain: [0, 1], scheme: "cividis", label: "p(token)" }, opacity: 0.6 });
  const response = await call("/v1/models");
  const data = await response.json();
  if (!response.ok) {
    $("status").textContent = data.error ? data.error.message : "the server is not ready";
    setTimeout(start, 1000);
    return;
  }
  state.models = data.data;
  fillModels();
  $("model").addEventListener("focus", refreshModels);
  setInterval(refreshModels, REFRESH_MS);
  wireSettings();
  await fillCorpora();
  wireViews();
  const view = restoreState();
  document.body.dataset.ready = "true";
  showView(view, false);
}

start();
