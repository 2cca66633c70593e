// The Inside view's attention panel: every head of a layer small, one enlarged with its weights
// on hover, and beside it the scheme's own signal in attention (a score bias or rope's angles).
/* global d3 */

import { $, note, visible } from "./dom.js";
import { biasHeatmap, headImage, imageCanvas, labelAxes, rotationChart, weightAt } from "./heatmap.js";
import { BIAS_MEANING, LAYER_BIAS_MEANING, positionNote } from "./schemes.js";
import { state } from "./state.js";

// attention_uint8 → {data: Uint8Array [L·H·T(T+1)/2], layers, heads, length}.
export function unpackAttention(trace) {
  if (!trace.attention_uint8) return null;
  const binary = atob(trace.attention_uint8);
  const data = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) data[i] = binary.charCodeAt(i);
  return { data, layers: trace.n_layers, heads: trace.n_heads, length: trace.tokens.length };
}

export function drawAttention() {
  const last = state.lastTrace;
  if (!last || !last.attention) return;
  const started = performance.now();
  const { trace, attention } = last;
  const layer = Number($("layer").value);
  const head = Number($("head").value);
  const labels = trace.tokens.map((t) => visible(t.text));
  const length = labels.length;
  drawHeads(trace, attention, layer, head);
  const size = Math.min(460, Math.max(280, 6 * length));
  const target = $("attention-chart");
  target.replaceChildren(...enlargedHead(attention, labels, layer, head, size));
  target.dataset.layer = String(layer);
  target.dataset.head = String(head);
  target.dataset.cells = String((length * (length + 1)) / 2);
  drawSchemeSide(trace, layer, head, size);
  target.dataset.ms = String(performance.now() - started);
  target.dataset.drawn = String(Number(target.dataset.drawn || 0) + 1);
}

// The small multiples: every head of this layer; a click enlarges one.
function drawHeads(trace, attention, layer, head) {
  $("heads").replaceChildren(...d3.range(trace.n_heads).map((h) => {
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
    button.addEventListener("click", () => { // as if picked: both panels that show the head follow
      $("head").value = String(h);
      $("head").dispatchEvent(new Event("change"));
    });
    return button;
  }));
}

// The chosen head at `size` pixels, its tokens along both axes: its title and canvas, which
// reads a weight out under the pointer.
function enlargedHead(attention, labels, layer, head, size) {
  const length = labels.length;
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
  return [title, canvas];
}

// Beside the head: the score bias the scheme adds there, rope's angles, or a note.
function drawSchemeSide(trace, layer, head, size) {
  const length = trace.tokens.length;
  const side = $("position-chart");
  if (trace.position_bias) {
    const what = BIAS_MEANING[trace.scheme] ?? "bias";
    side.replaceChildren(biasHeatmap(trace.position_bias[head], size, `${trace.scheme} score bias, head ${head}: ${what} (all layers)`));
  } else if (trace.layer_bias) {
    const what = LAYER_BIAS_MEANING[trace.scheme] ?? "bias";
    side.replaceChildren(biasHeatmap(trace.layer_bias[layer][head], size, `${trace.scheme} score bias, layer ${layer}, head ${head}: ${what}`));
  } else if (trace.rotation) {
    if (side.dataset.scheme !== "rope" || side.dataset.length !== `${trace.positions[0]}+${length}`) {
      side.replaceChildren(rotationChart(trace.rotation, size + 60, "rope: rotation angle per dimension pair (mod 2π), all heads and layers", trace.positions));
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
}
