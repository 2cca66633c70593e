// The ordinal playground. It talks only to this server: /v1/models, /v1/tokenize,
// /v1/completions (streamed, Server-Sent Events), /v1/trace and /v1/geometry. Charts are Observable Plot
// marks (cell = heatmap, bar = bars, line), on the d3 vendored beside it; the page draws no
// SVG or canvas of its own.
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

const probColour = (p) => {
  const colour = d3.color(d3.interpolateRdYlGn(p));
  colour.opacity = 0.5;
  return colour.formatRgb();
};
const SURPRISAL_MAX = 14; // bits
const surprisalColour = (bits) => {
  const colour = d3.color(d3.interpolateOrRd(Math.min(bits, SURPRISAL_MAX) / SURPRISAL_MAX));
  colour.opacity = 0.55;
  return colour.formatRgb();
};

function legend(target, options) {
  const node = Plot.legend({ width: 220, ...options });
  node.style.opacity = options.opacity ?? 1;
  $(target).replaceChildren(node);
}

// ---- tabs ---------------------------------------------------------------------------------

function showView(view) {
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
}

// ---- Generate -----------------------------------------------------------------------------

function tokenSpan(text, title, background) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text;
  span.title = title;
  span.style.background = background;
  return span;
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
  $("generate").disabled = true;
  $("stop").disabled = false;
  const stats = $("generate-stats");
  stats.textContent = "…";
  try {
    const { tokens: promptIds } = await post("/v1/tokenize", { model: name, prompt });
    const generation = (state.generation = { model: name, promptIds, ids: [], settings });
    const started = performance.now();
    let first = null;
    let finish = null;
    const body = {
      model: name,
      prompt: promptIds,
      max_tokens: Number($("max_tokens").value),
      seed: Number($("seed").value),
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
      const span = tokenSpan(choice.text, `p = ${p.toFixed(3)} — click for alternatives`, probColour(p));
      span.dataset.index = index;
      span.addEventListener("click", () => showAlternatives(index, span));
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
    heading.textContent = `Token ${index + 1}: “${visible(span.textContent)}” — the alternatives before and after each stage`;
    target.replaceChildren(heading, stagesChart(trace, generation.ids[index]));
  } catch (error) {
    target.replaceChildren();
    showError(target, error);
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
      });
    }
  }
  const order = [...shown].map(([id, text]) => `${visible(text)} ·${id}`);
  return Plot.plot({
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
        fx: "stage", y: "token", x: "prob", text: (d) => (d.prob >= 0.005 ? d.prob.toFixed(2) : ""),
        dx: 3, textAnchor: "start", fontSize: 9,
      }),
      Plot.ruleX([0]),
    ],
  });
}

// ---- Inside -------------------------------------------------------------------------------

function traceKey() {
  return JSON.stringify([model(), $("prompt").value]);
}

function scheduleTrace() {
  clearTimeout(state.traceTimer);
  state.traceTimer = setTimeout(runTrace, 150);
}

async function runTrace() {
  const key = traceKey();
  const stats = $("trace-stats");
  stats.textContent = "tracing…";
  try {
    const started = performance.now();
    const trace = await post("/v1/trace", {
      model: model(),
      prompt: $("prompt").value,
      ...samplingSettings(),
      top: 15,
    });
    const same = state.lastTrace && state.lastTrace.key === key;
    state.lastTrace = { key, trace };
    if (!same) drawPipeline(trace);
    drawStages(trace);
    stats.textContent = `${trace.tokens.length} tokens (limit ${trace.limit}) · ${trace.model}: ${trace.scheme} · ${Math.round(performance.now() - started)} ms`;
  } catch (error) {
    stats.textContent = "";
    for (const id of ["tokens-chart", "embedding-chart", "attention-chart", "position-chart", "stages-chart"]) {
      $(id).replaceChildren();
    }
    showError($("tokens-chart"), error);
  }
}

function drawStages(trace) {
  const target = $("stages-chart");
  target.replaceChildren(stagesChart(trace));
  target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);
}

function drawPipeline(trace) {
  const labels = trace.tokens.map((t) => visible(t.text));
  const length = labels.length;
  const positionTick = length <= 48 ? (i) => labels[i] : (i) => (i % 16 === 0 ? i : "");

  // 1. tokens and their surprisal
  const surprisal = trace.surprisal.map((bits, position) => ({ position, bits: bits ?? 0, token: labels[position] }));
  $("tokens-chart").replaceChildren(Plot.plot({
    width: Math.min(1100, Math.max(560, 22 * length)),
    height: length <= 48 ? 210 : 170,
    marginBottom: length <= 48 ? 70 : 34,
    x: { type: "band", label: "position", tickFormat: positionTick, tickRotate: length <= 48 ? -50 : 0 },
    y: { label: "bits", grid: true },
    color: { type: "linear", domain: [0, SURPRISAL_MAX], scheme: "OrRd" },
    marks: [
      Plot.barY(surprisal, { x: "position", y: "bits", fill: "bits", title: (d) => `${d.position}: ${d.token} — ${d.bits.toFixed(2)} bits` }),
      Plot.ruleY([0]),
    ],
  }));

  // 2. embeddings: norms per position, and the positional vectors as a heatmap
  const norms = trace.tokens.flatMap((_, position) => [
    { position, norm: trace.embedding.token_norm[position], kind: "token embedding" },
    ...(trace.embedding.position_norm
      ? [{ position, norm: trace.embedding.position_norm[position], kind: "positional vector" }]
      : []),
  ]);
  const parts = [Plot.plot({
    width: 420, height: 260,
    x: { label: "position" }, y: { label: "‖vector‖", grid: true, zero: true },
    color: { legend: true, domain: ["token embedding", "positional vector"], range: ["#3b5bdb", "#e8590c"] },
    marks: [Plot.lineY(norms, { x: "position", y: "norm", stroke: "kind", marker: length <= 48 ? "dot" : null })],
  })];
  const vectors = trace.embedding.position_vectors;
  if (vectors) {
    parts.push(vectorHeatmap(vectors, 460, 280));
  } else {
    parts.push(note(positionNote(trace.scheme)));
  }
  $("embedding-chart").replaceChildren(...parts);

  // 3. attention: layer and head pickers
  fillSelect($("layer"), trace.n_layers, "layer");
  fillSelect($("head"), trace.n_heads, "head");
  drawAttention();
}

// The positional vectors [T][d_model] as a position × dimension heatmap.
function vectorHeatmap(vectors, width, height, title) {
  const cells = vectors.flatMap((row, position) => row.map((value, dim) => ({ position, dim, value })));
  // A symmetric domain at the 99th percentile of |value|, so that a few large entries do not
  // wash out the rest (integer's grow without bound).
  const extent = d3.quantile(cells, 0.99, (d) => Math.abs(d.value)) || 1;
  return Plot.plot({
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
  return Plot.plot({
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

function drawAttention() {
  const trace = state.lastTrace && state.lastTrace.trace;
  if (!trace) return;
  const layer = Number($("layer").value);
  const head = Number($("head").value);
  const size = Math.min(440, Math.max(300, 6 * trace.tokens.length));
  const target = $("attention-chart");
  target.replaceChildren(heatmap(trace.attention[layer][head], {
    title: `Attention, layer ${layer}, head ${head} (rows sum to 1)`,
    scheme: "YlGnBu", label: "weight (square-root scale)", type: "sqrt", size, domain: [0, 1],
  }));
  target.dataset.layer = String(layer);
  target.dataset.head = String(head);
  target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);

  const side = $("position-chart");
  if (trace.position_bias) {
    side.replaceChildren(heatmap(trace.position_bias[head], {
      title: `${trace.scheme} score bias, head ${head}: ${BIAS_MEANING[trace.scheme] ?? "bias"} (all layers)`,
      scheme: "PuOr", type: "diverging", pivot: 0, label: "added to the score", size,
    }));
  } else if (trace.layer_bias) {
    side.replaceChildren(heatmap(trace.layer_bias[layer][head], {
      title: `${trace.scheme} score bias, layer ${layer}, head ${head}: ${LAYER_BIAS_MEANING[trace.scheme] ?? "bias"}`,
      scheme: "PuOr", type: "diverging", pivot: 0, label: "added to the score", size,
    }));
  } else if (trace.rotation) {
    side.replaceChildren(rotationChart(trace.rotation, size + 60,
      "rope: rotation angle per dimension pair (mod 2π), all heads and layers"));
  } else {
    side.replaceChildren(note(
      trace.embedding.position_vectors
        ? `${trace.scheme} changes nothing inside attention: position entered with the vector added to the embeddings (panel 2).`
        : positionNote(trace.scheme),
    ));
  }
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
  ["scale_free_stress", "scale-free stress"],
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
    if (report) drawReport(report, trace.scheme);
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
      title: "dot product vs distance: (R(i)·u)·(R(i+d)·u) for a unit all-equal u", y: "dot product",
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
  return Plot.plot({
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
  return Plot.plot({
    title, width: 440, height: 330, marginLeft: 50,
    x: { label: "distance (positions) →" }, y: { label: y, grid: true },
    color: stroke ? { legend: true } : undefined,
    marks: [Plot.ruleY([0]), Plot.lineY(points, { x: "distance", y: "value", stroke: stroke ?? "#3b5bdb", tip: true })],
  });
}

function drawReport(report, scheme) {
  const corpus = report.corpus;
  $("report-what").textContent = `corpus ${corpus.name}: ${corpus.n_sequences.toLocaleString()} sequences, ${corpus.n_positions} positions — ${report.schemes.some((s) => s.label.includes("(")) ? "the shipped checkpoints" : "every scheme untrained"}`;
  const own = report.schemes.find((entry) => entry.scheme === scheme);

  // dot product vs offset, as measured: every scheme, the chosen one drawn over the rest
  const lines = report.schemes.flatMap((entry) => (entry.dot_product_by_offset ?? [])
    .map((value, offset) => ({ offset, value, label: entry.label, chosen: entry.scheme === scheme }))
    .filter((d) => d.value !== null));
  $("profile-chart").replaceChildren(Plot.plot({
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
    row.classList.toggle("chosen", entry.scheme === scheme);
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
  const runs = names.map((name) => {
    const entry = modelInfo(name);
    const column = document.createElement("div");
    column.className = "column";
    column.dataset.model = name;
    const heading = document.createElement("h3");
    heading.innerHTML = "<b></b><span></span>";
    heading.firstChild.textContent = name;
    heading.lastChild.textContent = `trained at ${entry.context_length}`;
    const text = document.createElement("div");
    text.className = "text-output";
    column.append(heading, text);
    columns.append(column);
    return { name, entry, column, text, ids: [], spans: [] };
  });
  $("compare").disabled = true;
  try {
    await Promise.all(runs.map((run) => compareOne(run, prompt, settings, runs, controller.signal)));
  } finally {
    $("compare").disabled = false;
  }
}

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
    run.text.before(surprisalCurve(logprobs.token_logprobs, run.entry.context_length));
    run.text.append(prompts);
    const body = {
      model: run.name, prompt, max_tokens: Number($("max_tokens").value), seed: Number($("seed").value),
      logprobs: 0, return_tokens_as_token_ids: true, ...settings,
    };
    for await (const chunk of streamCompletion(body, signal)) {
      const choice = chunk.choices[0];
      if (!choice.logprobs) continue;
      const bits = -choice.logprobs.token_logprobs[0] / Math.LN2;
      const span = tokenSpan(choice.text, `${bits.toFixed(2)} bits`, surprisalColour(bits));
      span.style.color = "#1d1d1f";
      run.ids.push(choice.logprobs.tokens[0]);
      run.spans.push(span);
      run.text.append(span);
      markDivergence(runs);
    }
  } catch (error) {
    if (error.name !== "AbortError") showError(run.text, error);
  }
}

// The prompt's surprisal by position (a moving mean over 16 tokens), with the training length
// marked: where a scheme stops extrapolating, the curve rises past the line.
function surprisalCurve(logprobs, trained) {
  const points = logprobs.slice(1).map((lp, i) => ({ position: i + 1, bits: -lp / Math.LN2 }));
  return Plot.plot({
    width: 240, height: 96, marginLeft: 28, marginBottom: 24, style: { fontSize: "9px" },
    x: { label: null, domain: [0, Math.max(trained, logprobs.length)] },
    y: { label: "bits", grid: true, domain: [0, 12], clamp: true },
    marks: [
      Plot.lineY(points, Plot.windowY({ k: 16, anchor: "end" }, { x: "position", y: "bits", stroke: "#c92a2a" })),
      Plot.ruleX([trained], { stroke: "#888", strokeDasharray: "3,3" }),
      Plot.text([trained], { x: (d) => d, frameAnchor: "top", dy: 4, dx: -3, textAnchor: "end", text: () => "trained length" }),
    ],
  });
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
  legend("prob-legend", { color: { type: "linear", domain: [0, 1], scheme: "RdYlGn", label: "p(token)" }, opacity: 0.6 });
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

  for (const button of document.querySelectorAll("#tabs button")) {
    button.addEventListener("click", () => showView(button.dataset.view));
  }
  for (const id of SLIDERS) {
    $(id).addEventListener("input", () => {
      showSliderValues();
      if (state.view === "inside") scheduleTrace();
    });
  }
  select.addEventListener("change", () => {
    showInfo();
    if (state.view === "inside") scheduleTrace();
    if (state.view === "encodings") drawEncodings();
  });
  const reports = await get("/v1/geometry");
  $("corpus").replaceChildren(...reports.data.map((entry) => new Option(`${entry.corpus} (${entry.n_positions} positions)`, entry.corpus)));
  if (reports.data.some((entry) => entry.corpus === "shakespeare")) $("corpus").value = "shakespeare";
  $("corpus").addEventListener("change", drawEncodings);
  $("prompt").addEventListener("input", () => { if (state.view === "inside") scheduleTrace(); });
  $("generate").addEventListener("click", generate);
  $("stop").addEventListener("click", stopRunning);
  $("compare").addEventListener("click", compare);
  $("trace").addEventListener("click", runTrace);
  $("layer").addEventListener("change", drawAttention);
  $("head").addEventListener("change", drawAttention);
  $("swap-order").addEventListener("click", swapWordOrder);
  $("long-prompt").addEventListener("click", () => { $("prompt").value = LONG_PROMPT; });
  $("all-models").addEventListener("click", () => { for (const box of boxes.querySelectorAll("input")) box.checked = true; });
  $("no-models").addEventListener("click", () => { for (const box of boxes.querySelectorAll("input")) box.checked = false; });
  document.body.dataset.ready = "true";
}

start();
