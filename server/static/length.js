// The Length view: each chosen model's surprisal at every position of one text, the prompt
// scored (POST /v1/completions with echo, logprobs 0 and max_tokens 0), on one chart against
// the training length; a text past a model's max_context is cut to it there, and the view says
// so. Each model's curve is fetched once per text: the boxes and the smoothing only redraw.
/* global d3 */

import { post } from "./api.js";
import { COMPARE_DEFAULT, ticked } from "./controls.js";
import { $, room, showError } from "./dom.js";
import { LONG_PASSAGE } from "./passage.js";
import { surprisalCurves } from "./plot.js";
import { modelInfo, state } from "./state.js";
import { saveState } from "./url.js";

// {model, tokens (of the whole text), bits per position from 1, trained, max}: the text cut to
// the model's max_context.
async function measure(name, text) {
  const entry = modelInfo(name);
  const { tokens } = await post("/v1/tokenize", { model: name, prompt: text });
  const kept = tokens.slice(0, entry.max_context);
  const answer = await post("/v1/completions", { model: name, prompt: kept, max_tokens: 0, echo: true, logprobs: 0 });
  const bits = answer.choices[0].logprobs.token_logprobs.slice(1).map((lp) => -lp / Math.LN2);
  return { model: name, tokens: tokens.length, bits, trained: entry.context_length, max: entry.max_context };
}

function surprisal(name, text) {
  const key = `${name}\n${text}`;
  if (!state.surprisal.has(key)) {
    if (state.surprisal.size > 48) state.surprisal.clear();
    state.surprisal.set(key, measure(name, text).catch((error) => { state.surprisal.delete(key); throw error; }));
  }
  return state.surprisal.get(key);
}

let timer = null;
export function scheduleLength() {
  clearTimeout(timer);
  timer = setTimeout(drawLength, 300);
}

export async function drawLength() {
  const text = $("length-text").value;
  const names = ticked("length-models");
  const key = JSON.stringify([text, names]);
  const chart = $("length-chart");
  chart.dataset.key = key;
  const stats = $("length-stats");
  stats.textContent = names.length ? "scoring…" : "tick a model";
  const started = performance.now();
  const answers = await Promise.all(names.map((name) => surprisal(name, text).catch((error) => ({ model: name, error }))));
  if (chart.dataset.key !== key) return; // a later text or choice is drawing
  state.lengths = answers;
  redraw();
  const tokens = d3.max(answers, (a) => a.tokens);
  stats.textContent = tokens ? `${tokens} tokens · ${Math.round(performance.now() - started)} ms` : "";
  saveState();
}

// The chart and the table from the curves fetched last, at the smoothing chosen now.
export function redraw() {
  const answers = state.lengths ?? [];
  const span = Number($("smoothing").value);
  $("smoothing-value").textContent = String(span);
  const series = answers.filter((a) => !a.error);
  const chart = $("length-chart");
  chart.replaceChildren();
  if (series.length) {
    const models = state.models.map((entry) => entry.id).filter((name) => answers.some((a) => a.model === name));
    const width = Math.min(1100, room(chart, 0, 900)); // drawn to fit: its text stays readable
    chart.append(surprisalCurves(series, models, { window: span, width, height: 300 }));
  }
  for (const failed of answers.filter((a) => a.error)) showError(chart, new Error(`${failed.model}: ${failed.error.message}`));
  chart.dataset.models = series.map((s) => s.model).join(",");
  chart.dataset.trained = [...new Set(series.map((s) => s.trained))].join(",");
  chart.dataset.drawn = String(Number(chart.dataset.drawn || 0) + 1);
  $("length-table").replaceChildren(...(series.length ? table(series) : []));
}

// Each model's mean surprisal within its training length and past it; below, where the text
// was cut to what a model serves.
function table(series) {
  const node = document.createElement("table");
  node.className = "measured";
  node.createCaption().textContent = "Mean surprisal, bits per token (unsmoothed)";
  const head = node.createTHead().insertRow();
  for (const text of ["model", "positions", "within the trained length", "past it"]) {
    const cell = document.createElement("th");
    cell.scope = "col";
    cell.textContent = text;
    head.append(cell);
  }
  const body = node.createTBody();
  for (const s of series) {
    const row = body.insertRow();
    const within = d3.mean(s.bits.slice(0, s.trained - 1));
    const past = s.bits.length >= s.trained ? d3.mean(s.bits.slice(s.trained - 1)) : null;
    const scheme = modelInfo(s.model)?.scheme;
    row.dataset.model = s.model;
    for (const text of [scheme && scheme !== s.model ? `${s.model} (${scheme})` : s.model, String(s.bits.length + 1),
      within.toFixed(2), past === null ? "—" : `${past.toFixed(2)} (${d3.format("+.2f")(past - within)})`]) {
      row.insertCell().textContent = text;
    }
  }
  const cuts = d3.groups(series.filter((s) => s.tokens > s.max), (s) => s.max).map(([max, cut]) =>
    `${cut.map((s) => s.model).join(", ")} read${cut.length === 1 ? "s" : ""} only the first ${max} of the ${cut[0].tokens} tokens: ${cut.length === 1 ? "its" : "their"} most.`);
  const said = document.createElement("p");
  said.className = "readout";
  said.id = "length-cut";
  said.textContent = cuts.join(" ");
  return [node, said];
}

// The view's model boxes (the ones ticked before, else Compare's defaults), from /v1/models.
export function fillLengthModels() {
  const boxes = $("length-models");
  const keep = boxes.querySelector("input") ? ticked("length-models") : COMPARE_DEFAULT;
  for (const label of boxes.querySelectorAll(":scope > label")) label.remove(); // not the legend
  for (const entry of state.models) {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.value = entry.id;
    box.checked = keep.includes(entry.id);
    label.append(box, entry.id);
    boxes.append(label);
  }
}

export function wireLength() {
  const text = $("length-text");
  text.defaultValue = LONG_PASSAGE; // the view opens on it; the URL carries only another text
  text.value = LONG_PASSAGE;
  text.addEventListener("input", scheduleLength);
  $("long-passage").addEventListener("click", () => { text.value = LONG_PASSAGE; drawLength(); });
  $("measure").addEventListener("click", drawLength);
  $("smoothing").addEventListener("input", () => { redraw(); saveState(); });
  $("length-models").addEventListener("change", scheduleLength);
  const all = (checked) => () => {
    for (const box of $("length-models").querySelectorAll("input")) box.checked = checked;
    scheduleLength();
  };
  $("length-all").addEventListener("click", all(true));
  $("length-none").addEventListener("click", all(false));
  for (const button of document.querySelectorAll("#length-presets button")) {
    button.addEventListener("click", () => {
      const names = button.dataset.length.split(",");
      for (const box of $("length-models").querySelectorAll("input")) box.checked = names.includes(box.value);
      text.value = LONG_PASSAGE;
      drawLength();
    });
  }
}
