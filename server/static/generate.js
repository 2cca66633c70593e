// The Generate view: one streamed continuation, each token shaded by its probability; a click
// on a token shows the alternatives at each sampling stage, and a branch from any of them.

import { post, streamCompletion } from "./api.js";
import { probColour } from "./colour.js";
import { samplingSettings } from "./controls.js";
import { $, clickable, showError, tokenSpan, visible } from "./dom.js";
import { stagesChart } from "./stages.js";
import { model, state, stopRunning } from "./state.js";

export async function generate() {
  stopRunning();
  const controller = (state.abort = new AbortController());
  const name = model();
  const prompt = $("prompt").value;
  const settings = samplingSettings();
  const output = $("output");
  const promptSpan = document.createElement("span");
  promptSpan.className = "prompt-text";
  promptSpan.textContent = prompt;
  output.replaceChildren(promptSpan);
  $("alternatives").replaceChildren();
  $("branch").replaceChildren();
  $("generate").disabled = true;
  $("stop").disabled = false;
  const stats = $("generate-stats");
  stats.textContent = "…";
  try {
    const { tokens: promptIds } = await post("/v1/tokenize", { model: name, prompt });
    const maxTokens = Number($("max_tokens").value);
    const seed = Number($("seed").value);
    const generation = (state.generation = { model: name, promptIds, ids: [], texts: [], settings, maxTokens, seed });
    const finish = await streamTokens(generation, output, stats, controller.signal);
    stats.textContent += finish ? ` · finished: ${finish}` : "";
  } catch (error) {
    if (error.name !== "AbortError") showError(output, error);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

// Streams `generation` into `output`, token by token, with the speed in `stats`; returns why
// it finished.
async function streamTokens(generation, output, stats, signal) {
  const body = {
    model: generation.model,
    prompt: generation.promptIds,
    max_tokens: generation.maxTokens,
    seed: generation.seed,
    logprobs: 1,
    return_tokens_as_token_ids: true,
    ...generation.settings,
  };
  const started = performance.now();
  let first = null;
  let finish = null;
  for await (const chunk of streamCompletion(body, signal)) {
    const choice = chunk.choices[0];
    finish = choice.finish_reason ?? finish;
    if (!choice.logprobs) continue;
    first ??= performance.now();
    const id = Number(choice.logprobs.tokens[0].slice("token_id:".length));
    const p = Math.exp(choice.logprobs.token_logprobs[0]);
    const index = generation.ids.length;
    generation.ids.push(id);
    generation.texts.push(choice.text);
    const span = tokenSpan(choice.text, `p = ${p.toFixed(3)} — click for alternatives`, probColour(p));
    span.dataset.index = index;
    clickable(span, () => showAlternatives(index, span));
    output.append(span);
    const seconds = (performance.now() - first) / 1000;
    stats.textContent = `${index + 1} tokens · first after ${Math.round(first - started)} ms · ${seconds > 0 ? ((index) / seconds).toFixed(0) : "–"} tokens/s`;
  }
  return finish;
}

async function showAlternatives(index, span) {
  const generation = state.generation;
  for (const other of document.querySelectorAll("#output .tok.selected")) other.classList.remove("selected");
  span.classList.add("selected");
  const target = $("alternatives");
  target.textContent = "tracing…";
  try {
    const prefix = [...generation.promptIds, ...generation.ids.slice(0, index)];
    const trace = await post("/v1/trace", {
      model: generation.model,
      prompt: prefix.slice(-256),
      ...generation.settings,
      top: 12,
      attention: false,
    });
    const heading = document.createElement("h2");
    heading.textContent = `Token ${index + 1}: “${visible(generation.texts[index])}” — the alternatives before and after each stage`;
    const branches = document.createElement("p");
    branches.className = "branches";
    branches.append("Branch: continue from ");
    const alternatives = trace.next_token.stages.at(-1).top.filter((entry) => entry.id !== generation.ids[index]).slice(0, 6);
    for (const entry of alternatives) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = `“${visible(entry.text)}” ${entry.prob.toFixed(2)}`;
      button.addEventListener("click", () => branch(index, entry.id, entry.text));
      branches.append(button);
    }
    if (!alternatives.length) branches.append("(no other token survives the filters here)");
    target.replaceChildren(heading, stagesChart(trace, generation.ids[index], target.clientWidth), branches);
  } catch (error) {
    target.replaceChildren();
    showError(target, error);
  }
}

// The continuation from token `index` forced to `id`, same seed and settings, beside the
// original from that token on: a completion whose prompt ends with the forced token.
async function branch(index, id, text) {
  const generation = state.generation;
  const target = $("branch");
  const original = document.createElement("div");
  original.className = "text-output";
  const forked = document.createElement("div");
  forked.className = "text-output";
  const column = (title, body) => {
    const wrap = document.createElement("div");
    const heading = document.createElement("h3");
    heading.textContent = title;
    wrap.append(heading, body);
    return wrap;
  };
  generation.texts.slice(index).forEach((piece, i) => {
    const span = tokenSpan(piece, i === 0 ? "the original token here" : "original", "transparent");
    if (i === 0) span.classList.add("diverge");
    original.append(span);
  });
  const first = tokenSpan(text, "the forced token: the first difference", "transparent");
  first.classList.add("diverge");
  forked.append(first);
  target.replaceChildren(column(`original, from token ${index + 1}`, original), column(`branch: “${visible(text)}” forced, seed ${generation.seed}`, forked));
  const body = {
    model: generation.model,
    prompt: [...generation.promptIds, ...generation.ids.slice(0, index), id],
    max_tokens: Math.max(1, generation.maxTokens - index - 1),
    seed: generation.seed,
    logprobs: 0,
    return_tokens_as_token_ids: true,
    ...generation.settings,
  };
  forked.dataset.prompt = JSON.stringify(body.prompt);
  try {
    for await (const chunk of streamCompletion(body)) {
      const choice = chunk.choices[0];
      if (choice.text) forked.append(tokenSpan(choice.text, "branch", "transparent"));
    }
    forked.dataset.done = "true";
  } catch (error) {
    showError(forked, error);
  }
}
