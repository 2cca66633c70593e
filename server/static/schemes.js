// What the page says of each scheme. Its claim (what the offset and the other experiments
// should show) comes from the server: each scheme class declares it, and /v1/models sends it
// with the scheme's kind, so a new scheme brings its own. The notes below say where each
// scheme's signal is drawn, for the schemes whose panels need one.

import { modelInfo } from "./state.js";

// The claim of a served model's scheme ("" for a model the page does not know).
export const claimOf = (name) => modelInfo(name)?.claim ?? "";

export function positionNote(scheme) {
  return {
    none: "none adds no positional vector, and nothing inside attention either: only the causal mask tells positions apart.",
    rope: "rope adds no vector to the embeddings: it rotates each head's queries and keys by an angle proportional to the position (panel 3, right).",
    alibi: "alibi adds no vector: it subtracts slope × distance from every attention score (panel 3, right).",
    t5: "t5 adds no vector: it adds a learned value per distance bucket to every attention score (panel 3, right).",
    fire: "fire adds no vector: a small learned function of the log distance over the log query position is added to every attention score (panel 3, right).",
    fox: "fox adds no vector: each token closes a forget gate per layer and head, and a key loses log f for every later token (panel 3, right: the layer's bias).",
    cope: "cope adds no vector: a key's position counts only the keys the query gates in, σ(q·k), and q·e[that position] is added to the score (panel 3, right).",
    irope: "irope adds no vector: it rotates queries and keys as rope does in layers 0–2, and leaves layer 3 without any position (NoPE); panel 4 shows that layer's scores as all content.",
    stickbreaking: "stick-breaking adds nothing to the vectors or the scores: its weights are a process over the keys, each taking σ(score) of what the later keys left, so recency comes from the order alone (panel 2: rows sum to at most 1).",
    path: "path adds no vector: every later token turns a key by its Householder transition I − β·w·wᵀ, chosen by that token, so what lies between key and query is the position (panel 3, right: what the transitions add to each score).",
    pathfox: "pathfox adds no vector: the later tokens turn each key by their Householder transitions and fade it by their forget gates (panel 3, right: both, added to the score).",
    pope: "pope adds no vector: each query and key component keeps its magnitude, softplus(x), and turns its phase by position × its own frequency (panel 4: each component's share).",
  }[scheme] ?? "";
}

export const BIAS_MEANING = {
  alibi: "−slope × distance",
  t5: "learned value per distance bucket",
  fire: "learned function of the interpolated distance",
};

export const LAYER_BIAS_MEANING = {
  fox: "Σ log f over the tokens after the key",
  cope: "q·e[contextual position]",
  path: "q·(H_i⋯H_{j+1}·k − k)/√d: what the transitions did to the key",
  pathfox: "Σ log f, plus what the transitions did to the key",
};
