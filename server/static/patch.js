// The Patch view, activation patching (POST /v1/patch): the corrupted prompt runs again with one
// residual stream at one position replaced by the clean run's, and each cell of the stream ×
// position grid says how much of the clean prompt's logit for the target that one copy brings
// back. Both prompts must be the same number of tokens: their counts show as they are typed,
// and the server's 400 says what is wrong.
/* global d3 */

import { post } from "./api.js";
import { inkOn, signedColour, signedScale } from "./colour.js";
import { $, fixed, visible } from "./dom.js";
import { legend } from "./plot.js";
import { model, modelInfo } from "./state.js";
import { fillTargets, saveState } from "./url.js";

// One preset per family of schemes (rotation, bias, an added vector, none), on one pair of
// prompts of equal length whose next word copies the changed one ("king" or "queen"), so that
// the families can be compared: where the word waits, and in which layer it reaches the end.
const CLEAN = "The king, my lord, the";
const CORRUPTED = "The queen, my lord, the";
const PRESETS = Object.fromEntries(["rope", "alibi", "learned", "none"].map((name) => [name, { model: name, clean: CLEAN, corrupted: CORRUPTED }]));

const request = () => ({
  model: model(), clean: $("clean").value, corrupted: $("corrupted").value,
  ...($("patch-target").value ? { target: Number($("patch-target").value) } : {}),
});

let timer = null;
export function schedulePatch() {
  clearTimeout(timer);
  timer = setTimeout(runPatch, 400);
}

export async function runPatch() {
  const body = request();
  const key = JSON.stringify(body);
  const grid = $("patch-grid");
  if (grid.dataset.key === key && grid.dataset.drawn) return; // drawn already
  grid.dataset.key = key;
  const readout = $("patch-readout");
  $("patch-stats").textContent = "patching…";
  countTokens(body);
  try {
    const started = performance.now();
    const answer = await post("/v1/patch", body);
    if (grid.dataset.key !== key) return; // a later change is patching
    readout.classList.remove("error");
    drawGrid(answer);
    readout.textContent = describe(answer);
    $("patch-stats").textContent = `${answer.clean_tokens.length} tokens × ${answer.streams.length} streams · ${answer.model}: ${answer.scheme} · ${Math.round(performance.now() - started)} ms`;
    saveState();
  } catch (error) {
    if (grid.dataset.key !== key) return;
    grid.replaceChildren();
    delete grid.dataset.drawn;
    readout.textContent = error.message; // e.g. the two prompts are not the same length
    readout.classList.add("error");
    $("patch-stats").textContent = "";
  }
}

// Each prompt's length in tokens beside it, and the clean prompt's most probable next tokens
// in the target picker.
async function countTokens(body) {
  try {
    const [clean, corrupted] = await Promise.all([body.clean, body.corrupted].map((prompt) => post("/v1/tokenize", { model: body.model, prompt })));
    $("clean-count").textContent = `${clean.count} tokens`;
    $("corrupted-count").textContent = clean.count === corrupted.count ? `${corrupted.count} tokens` : `${corrupted.count} tokens: not ${clean.count}`;
    const next = await post("/v1/trace", { model: body.model, prompt: body.clean, attention: false, top: 10 });
    if ($("patch-grid").dataset.key !== JSON.stringify(body)) return;
    fillTargets($("patch-target"), next.next_token.stages[0].top, "clean's most probable");
  } catch {
    // the patch itself says what is wrong with the prompts
  }
}

// Rows: the stream entering layer 0 and each layer's output; columns: the clean prompt's
// tokens, the corrupted one beneath where it differs. Each cell coloured by its effect on one
// scale, 0 white and 1 dark purple (below 0 orange), its number written in it.
function drawGrid(answer) {
  const colour = signedColour(1);
  const table = document.createElement("table");
  table.className = "lens patch";
  const head = table.createTHead();
  const tokens = head.insertRow();
  const differs = answer.clean_tokens.map((token, p) => token.id !== answer.corrupted_tokens[p].id);
  tokens.append(th("clean", "row"), ...answer.clean_tokens.map((token, p) => th(visible(token.text), "col", differs[p])));
  const corrupted = head.insertRow(); // its token where it differs from clean's
  corrupted.append(th("corrupted", "row"));
  answer.corrupted_tokens.forEach((token, p) => {
    const cell = corrupted.insertCell();
    if (differs[p]) Object.assign(cell, { textContent: visible(token.text), className: "changed" });
  });
  const body = table.createTBody();
  answer.effect.forEach((row, s) => {
    const line = body.insertRow();
    line.append(th(answer.streams[s], "row"));
    row.forEach((value, p) => {
      const cell = line.insertCell();
      const background = colour(value);
      cell.textContent = fixed(value);
      cell.style.background = background;
      cell.style.color = inkOn(background);
      cell.title = `${answer.streams[s]} at “${visible(answer.clean_tokens[p].text)}” (${p}) patched in: ${value.toFixed(3)} of the clean logit's difference restored`;
    });
  });
  const grid = $("patch-grid");
  grid.replaceChildren(table);
  grid.dataset.cells = String(answer.effect.length * answer.clean_tokens.length);
  grid.dataset.drawn = String(Number(grid.dataset.drawn || 0) + 1);
  legend("patch-legend", { color: { ...signedScale(1, "share of the clean logit restored"), legend: undefined }, width: 260 });
}

function th(text, scope, changed = false) {
  const cell = document.createElement("th");
  cell.scope = scope;
  cell.textContent = text;
  if (changed) cell.className = "changed";
  return cell;
}

// The target, both logits, and where the difference is carried: the position that restores
// most at the embedding, and the first layer after which the last position alone restores half.
function describe(answer) {
  const last = answer.clean_tokens.length - 1;
  const strongest = d3.maxIndex(answer.effect[0]);
  const half = answer.effect.findIndex((row) => row[last] >= 0.5);
  return `Target “${visible(answer.target.text)}” (token ${answer.target.id}): logit ${answer.clean_logit.toFixed(2)} after the clean prompt, ` +
    `${answer.corrupted_logit.toFixed(2)} after the corrupted one. At the embedding, patching “${visible(answer.clean_tokens[strongest].text)}” ` +
    `(${strongest}) restores most (${answer.effect[0][strongest].toFixed(2)}); ` +
    (half < 0 ? "the last position alone never restores half." : `from ${answer.streams[half]} on, the last position alone restores half or more.`);
}

export function applyPatchPreset(name) {
  const preset = PRESETS[name];
  if (!modelInfo(preset.model)) return;
  $("model").value = preset.model;
  $("clean").value = preset.clean;
  $("corrupted").value = preset.corrupted;
  $("patch-target").value = "";
  $("model").dispatchEvent(new Event("change")); // the settings' description, the URL, a run
}

export function wirePatch() {
  $("patch-run").addEventListener("click", () => { delete $("patch-grid").dataset.drawn; runPatch(); });
  for (const id of ["clean", "corrupted"]) $(id).addEventListener("input", schedulePatch);
  $("patch-target").addEventListener("change", runPatch);
  for (const button of document.querySelectorAll("#patch-presets button")) {
    button.addEventListener("click", () => applyPatchPreset(button.dataset.patch));
  }
}
