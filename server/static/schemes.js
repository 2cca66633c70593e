// What the page says of each scheme: what the experiments should show (PREDICTIONS), and where
// each scheme's signal is drawn, for the schemes whose panels need a note.

export const PREDICTIONS = {
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

export function positionNote(scheme) {
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

export const BIAS_MEANING = {
  alibi: "−slope × distance",
  t5: "learned value per distance bucket",
  fire: "learned function of the interpolated distance",
};

export const LAYER_BIAS_MEANING = {
  fox: "Σ log f over the tokens after the key",
  cope: "q·e[contextual position]",
};
