// The Compare view: one prompt and one seed, a column per model, each streaming its own
// continuation; the prompt's surprisal by position on one chart, where each column first leaves
// the others, and why each ended.
/* global d3 */

import { post, streamCompletion } from "./api.js";
import { surprisalColour } from "./colour.js";
import { comparedModels, samplingSettings } from "./controls.js";
import { $, showError, tokenSpan } from "./dom.js";
import { surprisalCurves } from "./plot.js";
import { modelInfo, state, stopRunning } from "./state.js";

const END_REASONS = {
  length: "reached max tokens",
  stop: "end of text (the model chose <|eos|>) or a stop sequence",
};

export async function compare() {
  stopRunning();
  const controller = (state.abort = new AbortController());
  const prompt = $("prompt").value;
  const settings = samplingSettings();
  const columns = $("columns");
  columns.replaceChildren();
  $("compare-curves").replaceChildren();
  const runs = comparedModels().map((name) => newColumn(name, columns));
  $("compare").disabled = true;
  $("compare-stop").disabled = false;
  try {
    await Promise.all(runs.map((run) => compareOne(run, prompt, settings, runs, controller.signal)));
  } finally {
    $("compare").disabled = false;
    $("compare-stop").disabled = true;
  }
}

// A model's column (its name and training length, its text, why it ended), and its run.
function newColumn(name, columns) {
  const entry = modelInfo(name);
  const column = document.createElement("div");
  column.className = "column";
  column.dataset.model = name;
  const heading = document.createElement("h2");
  heading.innerHTML = "<b></b><span></span>";
  heading.firstChild.textContent = name;
  heading.lastChild.textContent = `trained at ${entry.context_length}`;
  const text = document.createElement("div");
  text.className = "text-output";
  const ended = document.createElement("p");
  ended.className = "ended";
  column.append(heading, text, ended);
  columns.append(column);
  return { name, entry, column, text, ended, ids: [], spans: [], curve: null };
}

async function compareOne(run, prompt, settings, runs, signal) {
  try {
    const length = await scorePrompt(run, prompt, runs, signal);
    // A table scheme cannot go past its last position: ask for what fits, and say so.
    const room = run.entry.max_context - length;
    const asked = Number($("max_tokens").value);
    if (room <= 0) {
      run.ended.textContent = `ended: past the table — the prompt alone fills its ${run.entry.max_context} positions`;
      run.column.dataset.ended = "table";
      return;
    }
    const body = {
      model: run.name, prompt, max_tokens: Math.min(asked, room), seed: Number($("seed").value),
      logprobs: 0, return_tokens_as_token_ids: true, ...settings,
    };
    const finish = await streamColumn(run, body, runs, signal);
    const past = finish === "length" && room < asked;
    run.column.dataset.ended = past ? "table" : finish ?? "";
    run.ended.textContent = `ended after ${run.ids.length} tokens: ` + (past
      ? `past the table — its last position is ${run.entry.max_context - 1}`
      : END_REASONS[finish] ?? finish ?? "?");
  } catch (error) {
    if (error.name === "AbortError") {
      run.ended.textContent = `stopped after ${run.ids.length} tokens`;
      run.column.dataset.ended = "stopped";
    } else {
      showError(run.text, error);
    }
  }
}

// The prompt, scored: where each scheme stops predicting its own input. Shades the column's
// prompt by surprisal, redraws the shared chart, and returns the prompt's length in tokens.
async function scorePrompt(run, prompt, runs, signal) {
  const scored = await post("/v1/completions", {
    model: run.name, prompt, echo: true, max_tokens: 0, logprobs: 0,
  }, signal);
  const logprobs = scored.choices[0].logprobs;
  const prompts = document.createElement("span");
  prompts.className = "prompt-text";
  logprobs.tokens.forEach((token, position) => {
    const lp = logprobs.token_logprobs[position];
    const bits = lp === null ? 0 : -lp / Math.LN2;
    const start = logprobs.text_offset[position];
    const end = position + 1 < logprobs.tokens.length ? logprobs.text_offset[position + 1] : scored.choices[0].text.length;
    const span = tokenSpan(scored.choices[0].text.slice(start, end), `position ${position}: ${bits.toFixed(2)} bits`, surprisalColour(bits));
    if (position === run.entry.context_length) {
      span.classList.add("boundary");
      span.title += " — the first position past the training context";
    }
    prompts.append(span);
  });
  run.curve = logprobs.token_logprobs;
  drawCurves(runs);
  run.text.append(prompts);
  return logprobs.tokens.length;
}

// Streams the column's continuation, marking where the columns diverge; returns why it ended.
async function streamColumn(run, body, runs, signal) {
  let finish = null;
  for await (const chunk of streamCompletion(body, signal)) {
    const choice = chunk.choices[0];
    finish = choice.finish_reason ?? finish;
    if (!choice.logprobs) continue;
    const bits = -choice.logprobs.token_logprobs[0] / Math.LN2;
    const span = tokenSpan(choice.text, `${bits.toFixed(2)} bits`, surprisalColour(bits));
    span.style.color = "#1d1d1f";
    run.ids.push(choice.logprobs.tokens[0]);
    run.spans.push(span);
    run.text.append(span);
    markDivergence(runs);
  }
  return finish;
}

// Every column's prompt surprisal by position (a moving mean over 16 tokens) on one chart, the
// training lengths marked: where a scheme stops extrapolating, its curve rises past the line.
function drawCurves(runs) {
  const drawn = runs.filter((run) => run.curve);
  const series = drawn.map((run) => ({
    model: run.name, bits: run.curve.slice(1).map((lp) => -lp / Math.LN2), trained: run.entry.context_length,
  }));
  const means = series.map(({ model, bits }) => `${model} ${d3.mean(bits).toFixed(2)}`);
  const figure = surprisalCurves(series, runs.map((run) => run.name));
  const caption = document.createElement("p");
  caption.className = "readout";
  caption.textContent = `Mean surprisal of the prompt (bits per token): ${means.join(" · ")}`;
  $("compare-curves").replaceChildren(figure, caption);
}

// Outline, in each column, the first token that differs from another column's at that index.
function markDivergence(runs) {
  for (const run of runs) {
    let first = -1;
    for (let i = 0; i < run.ids.length && first < 0; i++) {
      if (runs.some((other) => other !== run && i < other.ids.length && other.ids[i] !== run.ids[i])) first = i;
    }
    run.spans.forEach((span, i) => span.classList.toggle("diverge", i === first));
  }
}
