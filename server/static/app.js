// The ordinal playground. It talks only to this server: /v1/models, /v1/tokenize,
// /v1/completions (streamed, Server-Sent Events), /v1/trace and /v1/geometry. Charts are Observable Plot
// marks (bar, line, raster), on the d3 vendored beside it, except the attention and bias
// heatmaps: up to 256 × 256 cells per head, drawn to canvas as one pixel per cell, scaled.
/* global d3, Plot */

const $ = (id) => document.getElementById(id);
const SLIDERS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty"];
const COMPARE_DEFAULT = ["rope", "alibi", "none"];
const LONG_PROMPT = `ROMEO:
He jests at scars that never felt a wound.
But, soft! what light through yonder window breaks?
It is the east, and Juliet is the sun.
Arise, fair sun, and kill the envious moon,
Who is already sick and pale with grief,
That thou her maid art far more fair than she:
Be not her maid, since she is envious;
Her vestal livery is but sick and green
And none but fools do wear it; cast it off.
It is my lady, O, it is my love!
O, that she knew she were!
She speaks yet she says nothing: what of that?
Her eye discourses; I will answer it.
I am too bold, 'tis not to me she speaks:
Two of the fairest stars in all the heaven,
Having some business, do entreat her eyes
To twinkle in their spheres till they return.
What if her eyes were there, they in her head?
The brightness of her cheek would shame those stars,
As daylight doth a lamp; her eyes in heaven
Would through the airy region stream so bright
That birds would sing and think it were not night.`;

const state = {
  models: [], // entries of GET /v1/models
  view: "generate",
  generation: null, // {promptIds, ids, settings, model}
  abort: null, // AbortController of the running Generate or Compare
  lastTrace: null, // {key, trace}
  traceTimer: null,
  reports: new Map(), // corpus → report.json of `ordinal geometry` (GET /v1/geometry/{corpus})
  positional: new Map(), // model → its trace without attention, over its training length
  traces: new Map(), // request JSON → promise of its trace (the baseline and experiment traces)
  pending: null, // settings from the URL not yet applied (the experiment's boxes come later)
};

// ---- talking to the server ----------------------------------------------------------------

class ServerError extends Error {}

// A server started with ORDINAL_API_KEY wants `Authorization: Bearer KEY` on /v1/*: the page
// asks for the key once (on the first 401) and keeps it for this tab only.
const KEY_STORAGE = "ordinal-api-key";

async function call(path, options = {}) {
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = { ...(options.headers ?? {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  const response = await fetch(path, { ...options, headers });
  if (response.status !== 401) return response;
  const entered = window.prompt("This ordinal server needs its API key:");
  if (!entered) return response;
  sessionStorage.setItem(KEY_STORAGE, entered.trim());
  return call(path, options);
}

async function post(path, body, signal) {
  return answer(await call(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  }));
}

async function get(path) {
  return answer(await call(path));
}

async function answer(response) {
  const data = await response.json();
  if (!response.ok) throw new ServerError(data.error ? data.error.message : response.statusText);
  return data;
}

// Yields each `data:` payload of a streamed completion (parsed), until [DONE].
async function* streamCompletion(body, signal) {
  const response = await call("/v1/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) {
    const data = await response.json();
    throw new ServerError(data.error ? data.error.message : response.statusText);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const payload = event.slice(6);
      if (payload === "[DONE]") return;
      const data = JSON.parse(payload);
      if (data.error) throw new ServerError(data.error.message);
      yield data;
    }
  }
}

// ---- settings -----------------------------------------------------------------------------

function samplingSettings() {
  const value = (id) => Number($(id).value);
  return {
    temperature: value("temperature"),
    top_k: Math.round(value("top_k")),
    top_p: value("top_p"),
    min_p: value("min_p"),
    repetition_penalty: value("repetition_penalty"),
  };
}

function showSliderValues() {
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

const model = () => $("model").value;
const modelInfo = (name) => state.models.find((entry) => entry.id === name);
const formatCount = (n) => (n >= 1e6 ? `${(n / 1e6).toFixed(2)} M` : `${(n / 1e3).toFixed(1)} k`);

function describeModel(entry) {
  const table = entry.max_positions ? `, table of ${entry.max_positions} positions` : "";
  return `scheme ${entry.scheme} · trained at ${entry.context_length} tokens${table} · serves up to ${entry.max_context} · ${formatCount(entry.parameters)} parameters`;
}

// How a token is shown: visible whitespace in charts, raw text in the running output.
const visible = (text) => text.replace(/\n/g, "↵").replace(/ /g, "␣") || "∅";

// ---- colours (d3 scales; the same ones the legends show) -----------------------------------

// Probability: cividis (dark blue → yellow), readable under every common colour blindness;
// light enough behind text at this opacity.
const probColour = (p) => {
  const colour = d3.color(d3.interpolateCividis(p));
  colour.opacity = 0.45;
  return colour.formatRgb();
};
const SURPRISAL_MAX = 14; // bits
const surprisalColour = (bits) => {
  const colour = d3.color(d3.interpolateViridis(1 - Math.min(bits, SURPRISAL_MAX) / SURPRISAL_MAX));
  colour.opacity = 0.35; // light enough that dark text keeps a 4.5:1 contrast on every shade
  return colour.formatRgb();
};

// Plot names its mark groups with aria-label on plain <g> elements, which ARIA permits only on
// elements with a role: they are groups.
function accessible(node) {
  for (const group of node.querySelectorAll("g[aria-label]:not([role])")) group.setAttribute("role", "group");
  return node;
}

const plot = (options) => accessible(Plot.plot(options));

function legend(target, options) {
  const node = accessible(Plot.legend({ width: 220, ...options }));
  // Only the colour ramp is faded (as the tokens are); the text keeps its contrast.
  for (const ramp of node.querySelectorAll("image, rect")) ramp.style.opacity = options.opacity ?? 1;
  $(target).replaceChildren(node);
}

// ---- tabs ---------------------------------------------------------------------------------

function showView(view, push = true) {
  state.view = view;
  document.body.dataset.view = view;
  for (const button of document.querySelectorAll("#tabs button")) {
    button.setAttribute("aria-selected", String(button.dataset.view === view));
  }
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${view}`;
  }
  if (view === "inside") runTrace();
  if (view === "encodings") drawEncodings();
  saveState(push);
}

// ---- the URL: view, models, prompt, settings and experiment, so that reload keeps them,
// Back and Forward move between views, and a link reproduces the view --------------------

const URL_INPUTS = ["prompt", ...SLIDERS, "max_tokens", "seed", "offset"];

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

function saveState(push = false) {
  if (document.body.dataset.ready !== "true") return;
  const url = `?${currentParams()}`;
  if (url === location.search) return;
  history[push ? "pushState" : "replaceState"](null, "", url);
}

// Applies the URL's settings to the controls; returns the view it names.
function restoreState() {
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
  return ["generate", "compare", "inside", "encodings"].includes(view) ? view : "generate";
}

function restoreExperiment() {
  const pending = state.pending;
  if (!pending) return;
  for (const box of document.querySelectorAll("#drop input[data-layer]")) box.checked = pending.drop.includes(box.dataset.layer);
  for (const box of document.querySelectorAll("#ablate input")) box.checked = pending.ablate.includes(`${box.dataset.layer}.${box.dataset.head}`);
}

function restoreAttentionChoice() {
  const pending = state.pending;
  if (!pending) return;
  if (pending.layer !== null && pending.layer < $("layer").options.length) $("layer").value = pending.layer;
  if (pending.head !== null && pending.head < $("head").options.length) $("head").value = pending.head;
  state.pending = null; // both the boxes and the pickers exist now
}

// ---- Generate -----------------------------------------------------------------------------

// A token in running text: a newline shows as ↵ before the line break, and the token can be
// reached with Tab and explained with Enter (its title is also its accessible name).
function tokenSpan(text, title, background) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text.replace(/\n/g, "↵\n");
  span.title = title;
  span.style.background = background;
  return span;
}

function clickable(span, action) {
  span.tabIndex = 0;
  span.setAttribute("role", "button");
  span.setAttribute("aria-label", `${visible(span.textContent)}: ${span.title}`);
  span.addEventListener("click", action);
  span.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") { event.preventDefault(); action(); }
  });
}

async function generate() {
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
    const started = performance.now();
    let first = null;
    let finish = null;
    const body = {
      model: name,
      prompt: promptIds,
      max_tokens: maxTokens,
      seed,
      logprobs: 1,
      return_tokens_as_token_ids: true,
      ...settings,
    };
    for await (const chunk of streamCompletion(body, controller.signal)) {
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
    stats.textContent += finish ? ` · finished: ${finish}` : "";
  } catch (error) {
    if (error.name !== "AbortError") showError(output, error);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

function stopRunning() {
  if (state.abort) state.abort.abort();
  state.abort = null;
}

function showError(container, error) {
  const message = document.createElement("div");
  message.className = "error";
  message.textContent = error.message;
  container.append(message);
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
    target.replaceChildren(heading, stagesChart(trace, generation.ids[index]), branches);
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

// Bars of the next-token distribution, one small multiple per sampling stage.
function stagesChart(trace, chosen = null) {
  const stages = trace.next_token.stages;
  const shown = new Map(); // id → text, the tokens on the y axis
  for (const entry of stages[0].top.slice(0, 10)) shown.set(entry.id, entry.text);
  for (const entry of stages.at(-1).top.slice(0, 10)) shown.set(entry.id, entry.text);
  if (chosen !== null && !shown.has(chosen)) {
    const found = stages.flatMap((s) => s.top).find((entry) => entry.id === chosen);
    if (found) shown.set(chosen, found.text);
  }
  const rows = [];
  for (const stage of stages) {
    const probs = new Map(stage.top.map((entry) => [entry.id, entry.prob]));
    for (const [id, text] of shown) {
      rows.push({
        stage: `${stage.name} (${stage.kept} kept)`,
        token: `${visible(text)} ·${id}`,
        prob: probs.get(id) ?? 0,
        chosen: id === chosen,
        dropped: !probs.has(id), // a filter of this stage (or an earlier one) removed it
      });
    }
  }
  const order = [...shown].map(([id, text]) => `${visible(text)} ·${id}`);
  return plot({
    width: Math.max(620, 150 * stages.length),
    height: 28 + 19 * shown.size,
    marginLeft: 90,
    marginTop: 24,
    style: { fontSize: "11px" },
    fx: { domain: stages.map((s) => `${s.name} (${s.kept} kept)`), label: null, padding: 0.12 },
    x: { domain: [0, 1], ticks: [0, 0.5], label: "probability", grid: true },
    y: { domain: order, label: null },
    color: { domain: [false, true], range: ["#748ffc", "#e8590c"] },
    marks: [
      Plot.barX(rows, { fx: "stage", y: "token", x: "prob", fill: "chosen", tip: true }),
      Plot.text(rows, {
        fx: "stage", y: "token", x: "prob", text: (d) => (d.dropped ? "✕ dropped" : d.prob >= 0.005 ? d.prob.toFixed(2) : ""),
        dx: 3, textAnchor: "start", fontSize: 9, fill: (d) => (d.dropped ? "#b42318" : "currentColor"),
      }),
      Plot.ruleX([0]),
    ],
  });
}

// ---- Inside -------------------------------------------------------------------------------
// Three kinds of trace, so that a slider never re-fetches what it does not change:
//   the baseline (no experiment; attention, full next-token distribution), cached per prompt;
//   the experiment's (the same with the interventions, and the logit lens if asked);
//   the stages (sampling settings only, attention false), re-fetched when a slider moves.

const FULL = 65536; // `top` for the whole vocabulary: the total variation needs every token

function interventions() {
  const body = {};
  const offset = Number($("offset").value);
  if (offset) body.position_offset = offset;
  const dropped = [...document.querySelectorAll("#drop input[data-layer]:checked")].map((box) => Number(box.dataset.layer));
  if (dropped.length) body.drop_positional = dropped;
  const ablate = [...document.querySelectorAll("#ablate input:checked")].map((box) => ({ layer: Number(box.dataset.layer), head: Number(box.dataset.head) }));
  if (ablate.length) body.ablate = ablate;
  return body;
}

function traceKey() {
  return JSON.stringify([model(), $("prompt").value, interventions(), $("lens").checked]);
}

function scheduleTrace() {
  clearTimeout(state.traceTimer);
  state.traceTimer = setTimeout(runTrace, 150);
}

function scheduleStages() {
  clearTimeout(state.traceTimer);
  state.traceTimer = setTimeout(runStages, 120);
}

async function cachedTrace(body) {
  const key = JSON.stringify(body);
  if (!state.traces.has(key)) {
    if (state.traces.size > 16) state.traces.clear();
    state.traces.set(key, post("/v1/trace", body).catch((error) => { state.traces.delete(key); throw error; }));
  }
  return state.traces.get(key);
}

async function runTrace() {
  const key = traceKey();
  const stats = $("trace-stats");
  stats.textContent = "tracing…";
  const base = { model: model(), prompt: $("prompt").value, top: FULL, attention_encoding: "uint8" };
  const changes = interventions();
  const experiment = Object.keys(changes).length > 0;
  try {
    const started = performance.now();
    const asked = experiment || $("lens").checked;
    const [baseline, changed] = await Promise.all([
      cachedTrace(base),
      asked ? cachedTrace({ ...base, ...changes, logit_lens: $("lens").checked }).catch((error) => error) : null,
    ]);
    if (key !== traceKey()) return; // a later change is tracing
    if (changed instanceof Error) { // e.g. an offset past a table's last row: say so, keep the rest
      $("offset-effect").textContent = changed.message;
      $("offset-effect").classList.add("error");
      stats.textContent = "";
      return;
    }
    $("offset-effect").classList.remove("error");
    const trace = changed ?? baseline;
    state.lastTrace = { key, trace, baseline, attention: unpackAttention(trace) };
    state.baseAttention = changed ? unpackAttention(baseline) : state.lastTrace.attention;
    drawPipeline(trace, experiment ? baseline : null);
    drawEffect(trace, baseline, experiment);
    await runStages();
    stats.textContent = `${trace.tokens.length} tokens (limit ${trace.limit}) · ${trace.model}: ${trace.scheme} · ${Math.round(performance.now() - started)} ms`;
    saveState();
  } catch (error) {
    stats.textContent = "";
    for (const id of ["tokens-chart", "embedding-chart", "attention-chart", "position-chart", "stages-chart", "heads"]) {
      $(id).replaceChildren();
    }
    $("offset-effect").textContent = "";
    showError($("tokens-chart"), error);
  }
}

async function runStages() {
  try {
    const trace = await post("/v1/trace", {
      model: model(), prompt: $("prompt").value, ...interventions(), ...samplingSettings(), top: 15, attention: false,
    });
    drawStages(trace);
  } catch (error) {
    $("stages-chart").replaceChildren();
    showError($("stages-chart"), error);
  }
}

function drawStages(trace) {
  const target = $("stages-chart");
  target.replaceChildren(stagesChart(trace));
  target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);
}

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

const PREDICTIONS = {
  none: "none has no positional signal at all: the offset cannot change anything, and removing it removes nothing.",
  rope: "rope rotates queries and keys by their positions, and a dot product of two rotations depends only on their difference: the offset should change nothing (up to rounding).",
  alibi: "alibi subtracts slope × distance from each score: distances do not change with the offset, so nothing should move.",
  t5: "t5 adds a learned value per distance bucket: distances do not change with the offset, so nothing should move.",
  integer: "integer adds the position itself to every dimension: shifting it changes every vector, so the prediction moves.",
  binary: "binary adds the position's bits: shifted positions have different bits, so the prediction moves.",
  sinusoidal: "sinusoidal adds sines and cosines of the position: they are different at every position, so the prediction moves.",
  learned: "learned adds a trained vector per position, and stops at its table's last row: an offset moves the prediction, and past the table there is nothing to add (the server says so).",
  mds: "mds adds fixed coordinates per position from a table: an offset moves the prediction, and the table has a last row.",
  lowrank: "lowrank adds a learned low-rank vector per position from a table: an offset moves the prediction, and the table has a last row.",
};

function drawEffect(trace, baseline, experiment) {
  $("prediction").textContent = PREDICTIONS[trace.scheme] ?? "";
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
// shipped models give its top token about 0.2), so that every change shows.
const UNCERTAIN_PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou";
const PRESETS = {
  "offset-learned": { model: "learned", offset: 20 },
  "offset-rope": { model: "rope", offset: 20 },
  "drop-alibi": { model: "alibi", drop: "all" },
  lens: { model: "rope", lens: true },
  filters: { model: "rope", settings: { temperature: 1, top_k: 5, top_p: 0.5, min_p: 0, repetition_penalty: 1 } },
};

function applyPreset(name) {
  const preset = PRESETS[name];
  if (!modelInfo(preset.model)) return;
  $("model").value = preset.model;
  $("model").dispatchEvent(new Event("change"));
  $("prompt").value = UNCERTAIN_PROMPT;
  $("offset").value = String(preset.offset ?? 0);
  $("offset-value").textContent = $("offset").value;
  $("lens").checked = Boolean(preset.lens);
  for (const [id, value] of Object.entries(preset.settings ?? {})) $(id).value = String(value);
  showSliderValues();
  state.pending = { drop: preset.drop === "all" ? ["0", "1", "2", "3", "4", "5", "6", "7"] : [], ablate: [], layer: null, head: null };
  restoreExperiment();
  runTrace();
}

function fillExperimentControls(trace) {
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
  restoreExperiment(); // the URL's or a preset's boxes, which did not exist before this trace
  if (JSON.stringify(interventions()) !== traced) scheduleTrace();
}

function checkbox(text, data, name) {
  const label = document.createElement("label");
  label.className = "check";
  const box = document.createElement("input");
  box.type = "checkbox";
  for (const [key, value] of Object.entries(data)) box.dataset[key] = String(value);
  if (name) box.setAttribute("aria-label", name);
  label.append(box, text);
  return label;
}

function drawPipeline(trace, baseline) {
  const labels = trace.tokens.map((t) => visible(t.text));
  const length = labels.length;
  const positionTick = length <= 48 ? (i) => labels[i] : (i) => (i % 16 === 0 ? i : "");
  fillExperimentControls(trace);

  // 1. tokens and their surprisal (the unchanged pass as ticks, when an experiment is on)
  const surprisal = trace.surprisal.map((bits, position) => ({ position, bits: bits ?? 0, token: labels[position] }));
  const before = baseline ? baseline.surprisal.map((bits, position) => ({ position, bits: bits ?? 0 })) : [];
  $("tokens-chart").replaceChildren(plot({
    width: Math.min(1100, Math.max(560, 22 * length)),
    height: length <= 48 ? 210 : 170,
    marginBottom: length <= 48 ? 70 : 34,
    x: { type: "band", label: "position", tickFormat: positionTick, tickRotate: length <= 48 ? -50 : 0 },
    y: { label: "bits", grid: true },
    color: { type: "linear", domain: [0, SURPRISAL_MAX], scheme: "viridis", reverse: true },
    marks: [
      Plot.barY(surprisal, { x: "position", y: "bits", fill: "bits", title: (d) => `${d.position}: ${d.token} — ${d.bits.toFixed(2)} bits` }),
      Plot.tickY(before, { x: "position", y: "bits", stroke: "#111", strokeWidth: 2 }),
      Plot.ruleY([0]),
    ],
  }));

  // 2. embeddings: norms per position, and the positional vectors as a heatmap
  const norms = trace.tokens.flatMap((_, position) => [
    { position: trace.positions[position], norm: trace.embedding.token_norm[position], kind: "token embedding" },
    ...(trace.embedding.position_norm
      ? [{ position: trace.positions[position], norm: trace.embedding.position_norm[position], kind: "positional vector" }]
      : []),
  ]);
  const parts = [plot({
    width: 420, height: 260,
    x: { label: "position" }, y: { label: "‖vector‖", grid: true, zero: true },
    color: { legend: true, domain: ["token embedding", "positional vector"], range: ["#3b5bdb", "#c2410c"] },
    marks: [Plot.lineY(norms, { x: "position", y: "norm", stroke: "kind", marker: length <= 48 ? "dot" : null })],
  })];
  const vectors = trace.embedding.position_vectors;
  parts.push(vectors ? vectorHeatmap(vectors, 460, 280) : note(positionNote(trace.scheme)));
  $("embedding-chart").replaceChildren(...parts);

  // 3. attention: every head of the layer small, one enlarged
  fillSelect($("layer"), trace.n_layers, "layer");
  fillSelect($("head"), trace.n_heads, "head");
  restoreAttentionChoice();
  drawAttention();
  drawLens(trace);
}

// attention_uint8 → {data: Uint8Array [L·H·T(T+1)/2], layers, heads, length}.
function unpackAttention(trace) {
  if (!trace.attention_uint8) return null;
  const binary = atob(trace.attention_uint8);
  const data = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) data[i] = binary.charCodeAt(i);
  return { data, layers: trace.n_layers, heads: trace.n_heads, length: trace.tokens.length };
}

// A colour-blind-safe sequential scale (cividis), as 256 RGBA entries, level 0 white.
const ATTENTION_COLOURS = (() => {
  const table = new Uint8ClampedArray(256 * 4);
  for (let level = 0; level < 256; level++) {
    const colour = level === 0 ? d3.rgb(255, 255, 255) : d3.rgb(d3.interpolateCividis(1 - Math.sqrt(level / 255)));
    table.set([colour.r, colour.g, colour.b, 255], level * 4);
  }
  return table;
})();

// One head's lower triangle as an image of length × length pixels (one per query and key).
function headImage(attention, layer, head) {
  const { data, heads, length } = attention;
  const size = (length * (length + 1)) / 2;
  const offset = (layer * heads + head) * size;
  const image = new ImageData(length, length);
  const pixels = image.data;
  pixels.fill(255);
  let index = offset;
  for (let q = 0; q < length; q++) {
    for (let k = 0; k <= q; k++) {
      const level = data[index++];
      pixels.set(ATTENTION_COLOURS.subarray(level * 4, level * 4 + 4), (q * length + k) * 4);
    }
  }
  return image;
}

function weightAt(attention, layer, head, q, k) {
  const size = (attention.length * (attention.length + 1)) / 2;
  return attention.data[(layer * attention.heads + head) * size + (q * (q + 1)) / 2 + k] / 255;
}

// An image scaled onto a canvas of `size` CSS pixels, crisp (no smoothing), inside margins.
function imageCanvas(image, size, margin) {
  const canvas = document.createElement("canvas");
  const ratio = window.devicePixelRatio || 1;
  const full = size + margin.left + margin.right;
  const tall = size + margin.top + margin.bottom;
  canvas.width = Math.round(full * ratio);
  canvas.height = Math.round(tall * ratio);
  canvas.style.width = `${full}px`;
  canvas.style.maxWidth = "100%";
  const source = document.createElement("canvas");
  source.width = image.width;
  source.height = image.height;
  source.getContext("2d").putImageData(image, 0, 0);
  const context = canvas.getContext("2d");
  context.scale(ratio, ratio);
  context.imageSmoothingEnabled = false;
  context.fillStyle = "#fff";
  context.fillRect(0, 0, full, tall);
  context.drawImage(source, margin.left, margin.top, size, size);
  return { canvas, context };
}

// Token labels along both axes of a heatmap (every token when they fit, else every k-th).
function labelAxes(context, labels, size, margin) {
  const length = labels.length;
  const cell = size / length;
  const every = Math.max(1, Math.ceil(11 / cell));
  context.fillStyle = "#1d1d1f";
  context.font = `${Math.min(11, Math.max(8, cell))}px ui-monospace, monospace`;
  for (let i = 0; i < length; i += every) {
    const text = labels[i].length > 8 ? `${labels[i].slice(0, 7)}…` : labels[i];
    context.textAlign = "right";
    context.textBaseline = "middle";
    context.fillText(text, margin.left - 3, margin.top + (i + 0.5) * cell);
    context.save();
    context.translate(margin.left + (i + 0.5) * cell, margin.top + size + 3);
    context.rotate(-Math.PI / 3);
    context.fillText(text, 0, 0);
    context.restore();
  }
  context.textAlign = "left";
  context.fillText("↓ query (reads)", 2, 10);
  context.textAlign = "right";
  context.fillText("key (is read) →", margin.left + size, margin.top + size + margin.bottom - 4);
}

function drawAttention() {
  const last = state.lastTrace;
  if (!last || !last.attention) return;
  const started = performance.now();
  const { trace, attention } = last;
  const layer = Number($("layer").value);
  const head = Number($("head").value);
  const labels = trace.tokens.map((t) => visible(t.text));
  const length = labels.length;

  // the small multiples: every head of this layer; a click enlarges one
  const heads = $("heads");
  heads.replaceChildren(...d3.range(trace.n_heads).map((h) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "head-thumb";
    button.setAttribute("aria-pressed", String(h === head));
    button.dataset.head = String(h);
    const { canvas } = imageCanvas(headImage(attention, layer, h), 96, { left: 0, right: 0, top: 0, bottom: 0 });
    canvas.setAttribute("role", "img");
    canvas.setAttribute("aria-label", `attention of layer ${layer}, head ${h}`);
    const caption = document.createElement("span");
    caption.textContent = `head ${h}`;
    button.append(canvas, caption);
    button.addEventListener("click", () => { $("head").value = String(h); drawAttention(); saveState(); });
    return button;
  }));

  const size = Math.min(460, Math.max(280, 6 * length));
  const margin = { left: 72, right: 8, top: 16, bottom: 64 };
  const { canvas } = imageCanvas(headImage(attention, layer, head), size, margin);
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", `attention of layer ${layer}, head ${head}: each row a query token, each column a key token`);
  canvas.id = "attention-canvas";
  labelAxes(canvas.getContext("2d"), labels, size, margin);
  const hover = $("attention-hover");
  const pick = (event) => {
    const box = canvas.getBoundingClientRect();
    const scale = box.width / (size + margin.left + margin.right);
    const q = Math.floor(((event.clientY - box.top) / scale - margin.top) / (size / length));
    const k = Math.floor(((event.clientX - box.left) / scale - margin.left) / (size / length));
    if (q < 0 || q >= length || k < 0 || k > q) return;
    hover.textContent = `layer ${layer}, head ${head}: query “${labels[q]}” (${q}) → key “${labels[k]}” (${k}): weight ${weightAt(attention, layer, head, q, k).toFixed(3)}`;
  };
  canvas.addEventListener("mousemove", pick);
  canvas.addEventListener("click", pick);
  const title = document.createElement("p");
  title.className = "chart-title";
  title.textContent = `Attention, layer ${layer}, head ${head} (rows sum to 1; darker = more)`;
  const target = $("attention-chart");
  target.replaceChildren(title, canvas);
  target.dataset.layer = String(layer);
  target.dataset.head = String(head);
  target.dataset.cells = String((length * (length + 1)) / 2);

  const side = $("position-chart");
  if (trace.position_bias) {
    const what = BIAS_MEANING[trace.scheme] ?? "bias";
    side.replaceChildren(biasHeatmap(trace.position_bias[head], size, `${trace.scheme} score bias, head ${head}: ${what} (all layers)`));
  } else if (trace.layer_bias) {
    const what = LAYER_BIAS_MEANING[trace.scheme] ?? "bias";
    side.replaceChildren(biasHeatmap(trace.layer_bias[layer][head], size, `${trace.scheme} score bias, layer ${layer}, head ${head}: ${what}`));
  } else if (trace.rotation) {
    if (side.dataset.scheme !== "rope" || side.dataset.length !== `${trace.positions[0]}+${length}`) {
      side.replaceChildren(rotationChart(trace.rotation, size + 60, "rope: rotation angle per dimension pair (mod 2π), all heads and layers"));
    }
  } else {
    side.replaceChildren(note(
      trace.embedding.position_vectors
        ? `${trace.scheme} changes nothing inside attention: position entered with the vector added to the embeddings (panel 2).`
        : positionNote(trace.scheme),
    ));
  }
  side.dataset.scheme = trace.rotation ? "rope" : trace.scheme;
  side.dataset.length = `${trace.positions[0]}+${length}`; // rope's angles: redrawn for a new offset
  target.dataset.ms = String(performance.now() - started);
  target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);
}

// alibi's or t5's bias [T][q+1] on a canvas, diverging around 0 (orange below, purple above).
function biasHeatmap(matrix, size, text) {
  const length = matrix.length;
  const extent = d3.max(matrix, (row) => d3.max(row, Math.abs)) || 1;
  const colour = d3.scaleDiverging(d3.interpolatePuOr).domain([-extent, 0, extent]);
  const image = new ImageData(length, length);
  image.data.fill(255);
  for (let q = 0; q < length; q++) {
    for (let k = 0; k <= q; k++) {
      const c = d3.rgb(colour(matrix[q][k]));
      image.data.set([c.r, c.g, c.b, 255], (q * length + k) * 4);
    }
  }
  const margin = { left: 40, right: 8, top: 16, bottom: 30 };
  const { canvas, context } = imageCanvas(image, size, margin);
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", text);
  context.fillStyle = "#1d1d1f";
  context.font = "11px system-ui, sans-serif";
  context.fillText(`range ${(-extent).toFixed(2)} … ${extent.toFixed(2)} (added to the score)`, margin.left, margin.top + size + 20);
  const title = document.createElement("p");
  title.className = "chart-title";
  title.textContent = text;
  const wrap = document.createElement("div");
  wrap.dataset.cells = String((length * (length + 1)) / 2);
  wrap.className = "bias";
  wrap.append(title, canvas);
  return wrap;
}

// The logit lens: a layer × position grid of each layer's top-1 token, shaded by probability;
// a thick border on the first layer whose top-1 is already the last layer's.
function drawLens(trace) {
  const panel = $("lens-panel");
  const lens = trace.logit_lens;
  panel.hidden = !lens;
  if (!lens) return;
  const layers = lens.ids.length;
  const length = trace.tokens.length;
  const table = document.createElement("table");
  table.className = "lens";
  const head = table.createTHead().insertRow();
  const corner = document.createElement("th");
  corner.textContent = "layer \\ after";
  head.append(corner);
  for (let position = 0; position < length; position++) {
    const cell = document.createElement("th");
    cell.scope = "col";
    cell.textContent = visible(trace.tokens[position].text);
    head.append(cell);
  }
  const settled = d3.range(length).map((position) => {
    const final = lens.ids[layers - 1][position][0];
    return d3.range(layers).find((layer) => lens.ids[layer][position][0] === final);
  });
  const body = table.createTBody();
  for (let layer = 0; layer < layers; layer++) {
    const row = body.insertRow();
    const name = document.createElement("th");
    name.scope = "row";
    name.textContent = layer === layers - 1 ? `${layer} (served)` : String(layer);
    row.append(name);
    for (let position = 0; position < length; position++) {
      const cell = row.insertCell();
      const p = lens.probs[layer][position][0];
      cell.textContent = visible(lens.texts[layer][position][0]);
      cell.style.background = d3.interpolateCividis(1 - p * 0.85);
      cell.style.color = p > 0.45 ? "#fff" : "#111";
      cell.title = lens.texts[layer][position].map((text, i) => `${visible(text)} ${lens.probs[layer][position][i].toFixed(3)}`).join(" · ");
      if (settled[position] === layer) cell.classList.add("settled");
    }
  }
  $("lens-chart").replaceChildren(table);
  $("lens-chart").dataset.settled = JSON.stringify(settled);
}

// The positional vectors [T][d_model] as a position × dimension heatmap.
function vectorHeatmap(vectors, width, height, title) {
  const cells = vectors.flatMap((row, position) => row.map((value, dim) => ({ position, dim, value })));
  // A symmetric domain at the 99th percentile of |value|, so that a few large entries do not
  // wash out the rest (integer's grow without bound).
  const extent = d3.quantile(cells, 0.99, (d) => Math.abs(d.value)) || 1;
  return plot({
    title, width, height, marginLeft: 44,
    x: { label: "dimension", ticks: 8 }, y: { label: "position", reverse: false, ticks: 8 },
    color: { type: "linear", scheme: "RdBu", domain: [-extent, extent], clamp: true, legend: true, label: "value added" },
    marks: [Plot.raster(cells, { x: "dim", y: "position", fill: "value", interpolate: "none", imageRendering: "pixelated", width: vectors[0].length, height: vectors.length })],
  });
}

// rope's rotation angles [T][pairs] (mod 2π) as a position × dimension-pair heatmap.
function rotationChart(rotation, height, title) {
  const cells = rotation.flatMap((row, position) => row.map((angle, pair) => ({
    position, pair, angle: ((angle % (2 * Math.PI)) + 2 * Math.PI) % (2 * Math.PI),
  })));
  const every = rotation.length <= 24 ? 2 : 16;
  return plot({
    title, width: 360, height, marginLeft: 44, padding: 0,
    x: { type: "band", label: "dimension pair (fast → slow) →", tickFormat: (i) => (i % 4 === 0 ? i : "") },
    y: { type: "band", label: "↓ position", tickFormat: (i) => (i % every === 0 ? i : "") },
    color: { type: "linear", domain: [0, 2 * Math.PI], scheme: "Sinebow", label: "angle (rad)", legend: true },
    marks: [Plot.cell(cells, { x: "pair", y: "position", fill: "angle", inset: 0 })],
  });
}

function positionNote(scheme) {
  return {
    none: "none adds no positional vector, and nothing inside attention either: only the causal mask tells positions apart.",
    rope: "rope adds no vector to the embeddings: it rotates each head's queries and keys by an angle proportional to the position (panel 3, right).",
    alibi: "alibi adds no vector: it subtracts slope × distance from every attention score (panel 3, right).",
    t5: "t5 adds no vector: it adds a learned value per distance bucket to every attention score (panel 3, right).",
    fire: "fire adds no vector: a small learned function of the log distance over the log query position is added to every attention score (panel 3, right).",
    fox: "fox adds no vector: each token closes a forget gate per layer and head, and a key loses log f for every later token (panel 3, right: the layer's bias).",
    cope: "cope adds no vector: a key's position counts only the keys the query gates in, σ(q·k), and q·e[that position] is added to the score (panel 3, right).",
  }[scheme] ?? "";
}

const BIAS_MEANING = {
  alibi: "−slope × distance",
  t5: "learned value per distance bucket",
  fire: "learned function of the interpolated distance",
};
const LAYER_BIAS_MEANING = {
  fox: "Σ log f over the tokens after the key",
  cope: "q·e[contextual position]",
};

function note(text) {
  const paragraph = document.createElement("p");
  paragraph.className = "note";
  paragraph.textContent = text;
  return paragraph;
}

function fillSelect(select, count, what) {
  const previous = Number(select.value || 0);
  select.replaceChildren(...Array.from({ length: count }, (_, i) => new Option(`${what} ${i}`, String(i))));
  select.value = String(previous < count ? previous : 0);
}

function heatmap(matrix, { title, scheme, label, size, type = "linear", pivot, domain }) {
  const length = matrix.length;
  const cells = [];
  for (let q = 0; q < length; q++) {
    for (let k = 0; k <= q; k++) {
      const value = matrix[q][k];
      if (value !== null && value !== undefined) cells.push({ q, k, value });
    }
  }
  const every = length <= 24 ? 2 : length <= 64 ? 8 : 16;
  const ticks = (i) => (i % every === 0 ? i : "");
  return Plot.plot({
    title, width: size + 70, height: size + 60, marginLeft: 44, padding: 0,
    x: { type: "band", domain: d3.range(length), label: "key position →", tickFormat: ticks },
    y: { type: "band", domain: d3.range(length), label: "↓ query position", tickFormat: ticks },
    color: { type, scheme, label, legend: true, ...(pivot === undefined ? {} : { pivot }), ...(domain ? { domain } : {}) },
    marks: [Plot.cell(cells, { x: "k", y: "q", fill: "value", inset: 0, title: (d) => `query ${d.q}, key ${d.k}: ${d.value.toFixed(4)}` })],
  });
}

// ---- Encodings ----------------------------------------------------------------------------
// Per scheme: its positional vectors, bias or rotation over the training length (a trace of the
// served model, without attention), how they depend on distance, and what `ordinal geometry`
// measured (GET /v1/geometry/{corpus}: the committed report.json and its figures, unchanged).

const REQUIREMENT_COLUMNS = [
  ["bounded", "bounded_growth", "bounded (growth 4n/n)"],
  ["unique", "min_separation", "unique (min separation)"],
  ["length_independent", "length_drift", "length-independent (drift)"],
  ["smooth", "smoothness", "smooth (max step / median)"],
  ["relative_recoverable", "relative_error", "relative recoverable (error)"],
  ["beyond_max_positions", null, "past max_positions"],
];
const DIAGNOSTICS = [
  ["stress", "stress"],
  ["scale_free_stress", "stress after the best rescaling"],
  ["monotonicity_violation_rate", "monotonicity violations"],
  ["min_separation", "min separation"],
];
const FIGURE_CAPTIONS = {
  "hellinger.png": "Hellinger distance between the token distributions at each pair of positions",
  "eigenspectrum.png": "eigenvalues of the MDS Gram matrix: how many dimensions position needs",
  "mds_scatter.png": "the positions in the top two MDS coordinates",
  "stress.png": "stress of every scheme against the corpus geometry",
  "dot_products.png": "mean PE_i·PE_i+k against the offset, per scheme",
  "requirements.png": "the five requirements, measured, per scheme",
};

const formatNumber = (value) => (value === null || value === undefined ? "n/a" : typeof value === "number" ? d3.format(".3~g")(value) : String(value));
const verdict = (value) => (value === true ? "yes" : value === false ? "no" : "n/a");

async function positionalTrace(name) {
  if (!state.positional.has(name)) {
    const entry = modelInfo(name);
    const { tokens } = await post("/v1/tokenize", { model: name, prompt: LONG_PROMPT });
    // The positional pieces do not depend on the tokens: any prompt of the training length will do.
    const length = Math.min(entry.context_length, entry.max_context, 256) - 1;
    const prompt = Array.from({ length }, (_, i) => tokens[1 + (i % (tokens.length - 1))]);
    state.positional.set(name, await post("/v1/trace", { model: name, prompt, attention: false, top: 1 }));
  }
  return state.positional.get(name);
}

async function geometryReport(corpus) {
  if (!state.reports.has(corpus)) state.reports.set(corpus, await get(`/v1/geometry/${corpus}`));
  return state.reports.get(corpus);
}

async function drawEncodings() {
  const name = model();
  const corpus = $("corpus").value;
  const stats = $("encodings-stats");
  stats.textContent = "loading…";
  try {
    const [trace, report] = await Promise.all([positionalTrace(name), corpus ? geometryReport(corpus) : null]);
    if (name !== model() || corpus !== $("corpus").value) return; // a later choice is drawing
    drawPositional(trace);
    if (report) drawReport(report, trace);
    const view = $("view-encodings");
    view.dataset.scheme = trace.scheme;
    view.dataset.drawn = String(Number(view.dataset.drawn || 0) + 1);
    stats.textContent = `${trace.model}: ${trace.scheme}, positions 0–${trace.tokens.length - 1} (its training length)`;
  } catch (error) {
    stats.textContent = "";
    showError($("encoding-chart"), error);
  }
}

function drawPositional(trace) {
  const length = trace.tokens.length;
  const left = $("encoding-chart");
  const right = $("distance-chart");
  const vectors = trace.embedding.position_vectors;
  if (vectors) {
    left.replaceChildren(vectorHeatmap(vectors, 520, 330, `${trace.scheme}: the vector added at each position`));
    // The same profile the report measures: mean PE_i·PE_i+k over i, over the mean ‖PE_i‖².
    const dot = (a, b) => d3.sum(a, (value, i) => value * b[i]);
    const norm = d3.mean(vectors, (v) => dot(v, v));
    const points = d3.range(length).map((k) => ({
      distance: k, value: d3.mean(d3.range(length - k), (i) => dot(vectors[i], vectors[i + k])) / norm,
    }));
    right.replaceChildren(distancePlot(points, {
      title: "dot product vs distance: mean PE_i·PE_i+k / mean ‖PE_i‖²", y: "dot product",
    }));
  } else if (trace.position_bias) {
    const heads = trace.position_bias.length;
    const size = heads > 4 ? 150 : 190;
    left.replaceChildren(...trace.position_bias.map((matrix, head) => biasRaster(matrix, head, size)));
    // Row T−1 of each head: the bias the last query adds to a key d positions back.
    const points = trace.position_bias.flatMap((matrix, head) => matrix[length - 1].map((value, key) => ({
      distance: length - 1 - key, value, head: `head ${head}`,
    })));
    right.replaceChildren(distancePlot(points, {
      title: `score bias vs distance (${BIAS_MEANING[trace.scheme] ?? "bias"})`,
      y: "added to the score", stroke: "head",
    }));
  } else if (trace.forget_gates || trace.contextual_positions) {
    // Data-dependent: what this prompt made of positions, in layer 0 (per head).
    const gates = trace.forget_gates;
    left.replaceChildren(gates
      ? gateChart(gates)
      : heatmap(trace.contextual_positions[0][0], {
        title: "cope, layer 0, head 0: the position of each key seen from each query",
        scheme: "Viridis", label: "contextual position", size: 330,
      }));
    const perHead = gates ? trace.layer_bias[0] : trace.contextual_positions[0];
    const points = perHead.flatMap((matrix, head) => matrix[length - 1].map((value, key) => ({
      distance: length - 1 - key, value, head: `head ${head}`,
    })));
    right.replaceChildren(distancePlot(points, {
      title: gates
        ? "layer 0: the last query's bias vs distance (Σ log f; a straight line would be alibi)"
        : "layer 0: the last query's contextual position vs distance (the diagonal counts every token)",
      y: gates ? "added to the score" : "contextual position", stroke: "head",
    }));
  } else if (trace.rotation) {
    left.replaceChildren(rotationChart(trace.rotation, 330, "rope: the rotation angle per position and dimension pair (mod 2π)"));
    // q·k of one unit vector rotated at two positions d apart: the mean over pairs of cos(d·θ).
    const points = trace.rotation.map((angles, distance) => ({ distance, value: d3.mean(angles, Math.cos) }));
    right.replaceChildren(distancePlot(points, {
      title: "how alike two positions d apart look after rope's rotation (mean cos of d × each frequency)", y: "dot product",
    }));
  } else {
    left.replaceChildren(note(positionNote(trace.scheme)));
    right.replaceChildren(note("No positional vectors and no bias: every distance looks the same to attention."));
  }
  left.dataset.drawn = String(Number(left.dataset.drawn || 0) + 1);
}

// fox's forget gates [layers][heads][T] as a (layer, head) × position heatmap.
function gateChart(gates) {
  const cells = gates.flatMap((heads, layer) => heads.flatMap((row, head) => row.map((value, position) => ({
    row: `layer ${layer} head ${head}`, position, value,
  }))));
  return Plot.plot({
    title: "fox: the forget gate f of each token, per layer and head (1 = remember everything)",
    width: 520, height: 60 + 16 * gates.length * gates[0].length, marginLeft: 110,
    x: { type: "band", domain: d3.range(gates[0][0].length), label: "position →", tickFormat: (i) => (i % 16 === 0 ? i : "") },
    y: { label: null },
    color: { type: "linear", scheme: "Greens", domain: [0, 1], legend: true, label: "f" },
    marks: [Plot.cell(cells, { x: "position", y: "row", fill: "value", inset: 0, title: (d) => `${d.row}, position ${d.position}: ${d.value.toFixed(3)}` })],
  });
}

function biasRaster(matrix, head, size) {
  const length = matrix.length;
  const cells = matrix.flatMap((row, q) => row.map((value, k) => ({ q, k, value })));
  return plot({
    title: `head ${head}`, width: size + 40, height: size + 40, marginLeft: 34, marginBottom: 34,
    x: { domain: [0, length], label: "key →", ticks: 4 },
    y: { domain: [0, length], label: "↓ query", ticks: 4, reverse: true },
    // Each head on its own scale, from its most negative bias to 0 (white): alibi's slopes
    // differ by powers of two, and one shared scale would leave the gentle heads blank.
    color: { type: "linear", scheme: "Purples", reverse: true, domain: [d3.min(cells, (d) => d.value), Math.max(0, d3.max(cells, (d) => d.value))], legend: true, label: "bias", width: size },
    marks: [Plot.raster(cells, { x: (d) => d.k + 0.5, y: (d) => d.q + 0.5, fill: "value", width: length, height: length, interpolate: "none", imageRendering: "pixelated" })],
  });
}

function distancePlot(points, { title, y, stroke }) {
  return plot({
    title, width: 440, height: 330, marginLeft: 50,
    x: { label: "distance (positions) →" }, y: { label: y, grid: true },
    color: stroke ? { legend: true } : undefined,
    marks: [Plot.ruleY([0]), Plot.lineY(points, { x: "distance", y: "value", stroke: stroke ?? "#3b5bdb", tip: true })],
  });
}

// The report's rows for the traced model: the checkpoint's own row ("prope (rope)" for prope,
// rope's for rope+yarn4) where the report has one, else every row of its scheme (drope: none).
function reportRowsFor(report, trace) {
  const checkpoint = trace.model.split("+")[0];
  const own = report.schemes.filter((entry) => entry.label.startsWith(`${checkpoint} (`));
  const rows = own.length ? own : report.schemes.filter((entry) => entry.scheme === trace.scheme);
  return new Set(rows.map((entry) => entry.label));
}

function drawReport(report, trace) {
  const corpus = report.corpus;
  const scheme = trace.scheme;
  const chosen = reportRowsFor(report, trace);
  $("report-what").textContent = `corpus ${corpus.name}: ${corpus.n_sequences.toLocaleString()} sequences, ${corpus.n_positions} positions — ${report.schemes.some((s) => s.label.includes("(")) ? "the shipped checkpoints" : "every scheme untrained"}`;
  const own = report.schemes.find((entry) => chosen.has(entry.label));

  // dot product vs offset, as measured: every scheme, the chosen one drawn over the rest
  const lines = report.schemes.flatMap((entry) => (entry.dot_product_by_offset ?? [])
    .map((value, offset) => ({ offset, value, label: entry.label, chosen: chosen.has(entry.label) }))
    .filter((d) => d.value !== null));
  $("profile-chart").replaceChildren(plot({
    title: `measured: mean PE_i·PE_i+k / mean ‖PE_i‖² (${scheme} in colour)`,
    width: 460, height: 300, marginLeft: 44,
    x: { label: "offset k →" }, y: { label: "dot product", grid: true },
    marks: [
      Plot.ruleY([0]),
      Plot.lineY(lines.filter((d) => !d.chosen), { x: "offset", y: "value", z: "label", stroke: "#ccc", strokeWidth: 1 }),
      Plot.lineY(lines.filter((d) => d.chosen), { x: "offset", y: "value", stroke: "#e8590c", strokeWidth: 2.5, tip: true }),
    ],
  }));

  const diagnostics = document.createElement("table");
  diagnostics.className = "measured";
  diagnostics.innerHTML = "<caption></caption><tbody></tbody>";
  diagnostics.caption.textContent = own ? `${own.label} against the corpus geometry` : `no ${scheme} in this report`;
  for (const [key, label] of own ? DIAGNOSTICS : []) {
    const row = diagnostics.tBodies[0].insertRow();
    row.insertCell().textContent = label;
    row.insertCell().textContent = own.error ? own.error : formatNumber(own[key]);
  }
  $("diagnostics").replaceChildren(diagnostics);

  // the five requirements, measured: every scheme, the chosen one highlighted
  const table = document.createElement("table");
  table.className = "requirements";
  const head = table.createTHead().insertRow();
  for (const label of ["encoding", ...REQUIREMENT_COLUMNS.map(([, , text]) => text)]) {
    const cell = document.createElement("th");
    cell.textContent = label;
    head.append(cell);
  }
  const body = table.createTBody();
  for (const entry of report.requirements) {
    const row = body.insertRow();
    row.classList.toggle("chosen", chosen.has(entry.label));
    row.dataset.scheme = entry.scheme;
    row.insertCell().textContent = entry.label;
    for (const [flag, measure] of REQUIREMENT_COLUMNS) {
      const cell = row.insertCell();
      cell.className = `verdict-${verdict(entry[flag]).replace("/", "")}`;
      cell.textContent = verdict(entry[flag]) + (measure ? ` (${formatNumber(entry[measure])})` : "");
    }
  }
  $("requirements-table").replaceChildren(table);

  const figures = report.figures.map((figure) => {
    const element = document.createElement("figure");
    const image = new Image();
    image.src = `/v1/geometry/${encodeURIComponent(corpus.name)}/${encodeURIComponent(figure)}`;
    image.alt = FIGURE_CAPTIONS[figure] ?? figure;
    image.loading = "lazy";
    const caption = document.createElement("figcaption");
    caption.textContent = FIGURE_CAPTIONS[figure] ?? figure;
    element.append(image, caption);
    return element;
  });
  $("figures").replaceChildren(...figures);
}

// ---- Compare ------------------------------------------------------------------------------

function comparedModels() {
  return [...document.querySelectorAll("#compare-models input:checked")].map((box) => box.value);
}

async function compare() {
  stopRunning();
  const controller = (state.abort = new AbortController());
  const prompt = $("prompt").value;
  const settings = samplingSettings();
  const names = comparedModels();
  const columns = $("columns");
  columns.replaceChildren();
  $("compare-curves").replaceChildren();
  const runs = names.map((name) => {
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
  });
  $("compare").disabled = true;
  $("compare-stop").disabled = false;
  try {
    await Promise.all(runs.map((run) => compareOne(run, prompt, settings, runs, controller.signal)));
  } finally {
    $("compare").disabled = false;
    $("compare-stop").disabled = true;
  }
}

const END_REASONS = {
  length: "reached max tokens",
  stop: "end of text (the model chose <|eos|>) or a stop sequence",
};

async function compareOne(run, prompt, settings, runs, signal) {
  try {
    // The prompt, scored: where each scheme stops predicting its own input.
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
    // A table scheme cannot go past its last position: ask for what fits, and say so.
    const room = run.entry.max_context - logprobs.tokens.length;
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

// Every column's prompt surprisal by position (a moving mean over 16 tokens) on one chart, the
// training lengths marked: where a scheme stops extrapolating, its curve rises past the line.
function drawCurves(runs) {
  const drawn = runs.filter((run) => run.curve);
  const points = drawn.flatMap((run) => {
    const bits = run.curve.slice(1).map((lp) => -lp / Math.LN2);
    return bits.map((value, i) => ({
      model: run.name, position: i + 1,
      bits: d3.mean(bits.slice(Math.max(0, i - 15), i + 1)),
    }));
  });
  const means = drawn.map((run) => `${run.name} ${d3.mean(run.curve.slice(1), (lp) => -lp / Math.LN2).toFixed(2)}`);
  const trained = [...new Set(drawn.map((run) => run.entry.context_length))];
  const figure = plot({
    width: 900, height: 220, marginLeft: 40,
    x: { label: "position →" }, y: { label: "bits (mean of the last 16)", grid: true, zero: true },
    color: { legend: true, scheme: "observable10", domain: runs.map((run) => run.name) },
    marks: [
      Plot.lineY(points, { x: "position", y: "bits", stroke: "model", tip: true }),
      Plot.ruleX(trained, { stroke: "#555", strokeDasharray: "3,3" }),
      Plot.text(trained, { x: (d) => d, frameAnchor: "top", dy: 4, dx: -3, textAnchor: "end", text: (d) => `trained length ${d}` }),
    ],
  });
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

function swapWordOrder() {
  const text = $("prompt").value.trim();
  const match = text.match(/^(.*?)([.!?]*)$/s);
  const words = match[1].split(/\s+/).reverse();
  const fix = (word, i) => (i === 0 ? word[0].toUpperCase() + word.slice(1) : word === "I" ? word : word.toLowerCase());
  $("prompt").value = words.map(fix).join(" ") + match[2];
}

// ---- start --------------------------------------------------------------------------------

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
  const select = $("model");
  select.replaceChildren(...state.models.map((entry) => new Option(`${entry.id} (${entry.scheme}, ctx ${entry.context_length})`, entry.id)));
  select.value = (state.models.find((entry) => entry.default) ?? state.models[0]).id;
  const showInfo = () => { $("model-info").textContent = describeModel(modelInfo(model())); };
  showInfo();
  const boxes = $("compare-models");
  for (const entry of state.models) {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.value = entry.id;
    box.checked = COMPARE_DEFAULT.includes(entry.id);
    label.append(box, entry.id);
    boxes.append(label);
  }
  $("status").textContent = `${state.models.length} models loaded`;
  $("status").setAttribute("role", "status");

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
  select.addEventListener("change", () => {
    showInfo();
    if (state.view === "inside") scheduleTrace();
    if (state.view === "encodings") drawEncodings();
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
  const reports = await get("/v1/geometry");
  $("corpus").replaceChildren(...reports.data.map((entry) => new Option(`${entry.corpus} (${entry.n_positions} positions)`, entry.corpus)));
  if (reports.data.some((entry) => entry.corpus === "shakespeare")) $("corpus").value = "shakespeare";
  $("corpus").addEventListener("change", drawEncodings);
  $("prompt").addEventListener("input", () => { if (state.view === "inside") scheduleTrace(); });
  $("generate").addEventListener("click", generate);
  $("stop").addEventListener("click", stopRunning);
  $("compare").addEventListener("click", compare);
  $("trace").addEventListener("click", runTrace);
  $("compare-stop").addEventListener("click", stopRunning);
  for (const button of document.querySelectorAll("#presets button")) {
    button.addEventListener("click", () => applyPreset(button.dataset.preset));
  }
  for (const id of ["layer", "head"]) $(id).addEventListener("change", () => { drawAttention(); saveState(); });
  $("swap-order").addEventListener("click", swapWordOrder);
  $("long-prompt").addEventListener("click", () => { $("prompt").value = LONG_PROMPT; });
  $("all-models").addEventListener("click", () => { for (const box of boxes.querySelectorAll("input")) box.checked = true; });
  $("no-models").addEventListener("click", () => { for (const box of boxes.querySelectorAll("input")) box.checked = false; });
  const view = restoreState();
  document.body.dataset.ready = "true";
  showView(view, false);
}

start();
