"""Variable tracking (RULER's VT, on a tiny vocabulary): follow a chain of copies back to the
value it started from, past a second chain that distracts.

Two chains of three variables each, all six distinct: ``a=v``, then ``b=a``, then ``c=b`` (each
one token, the link after the one it copies), and another ``d=w``, ``e=d``, ``f=e``; their links
sit at random places among filler in the first T − 4 tokens. Then two queries ``x? v`` ask the
last variable of each chain, in a random order. Answers: each chain's value. Each answer takes
two hops back through the copies, wherever in the sequence they are.
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task

FILLERS = 8
VARIABLES = 8
VALUES = 8
ASSIGN_0 = FILLERS  # ASSIGN_0 + x·VALUES + v: x = v
COPY_0 = ASSIGN_0 + VARIABLES * VALUES  # COPY_0 + x·VARIABLES + y: x = y
QUERY_0 = COPY_0 + VARIABLES * VARIABLES  # QUERY_0 + x: x?
VALUE_0 = QUERY_0 + VARIABLES  # VALUE_0 + v: an answer
CHAINS = 2
HOPS = 2  # copies after each chain's assignment


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]."""
    links = CHAINS * (1 + HOPS)
    body = length - 2 * CHAINS
    tokens = rng.integers(0, FILLERS, size=(count, length))
    answers = np.zeros((count, length), dtype=bool)
    for row in range(count):
        names = rng.permutation(VARIABLES)[:links].reshape(CHAINS, 1 + HOPS)
        values = rng.integers(0, VALUES, size=CHAINS)
        # each chain's links in its own order, the two chains interleaved at random
        order = rng.permutation(np.repeat(np.arange(CHAINS), 1 + HOPS))
        places = np.sort(rng.choice(body, size=links, replace=False))
        step = np.zeros(CHAINS, dtype=np.int64)
        for place, chain in zip(places, order, strict=True):
            hop = step[chain]
            variable = names[chain, hop]
            if hop == 0:
                tokens[row, place] = ASSIGN_0 + variable * VALUES + values[chain]
            else:
                tokens[row, place] = COPY_0 + variable * VARIABLES + names[chain, hop - 1]
            step[chain] += 1
        for query, chain in enumerate(rng.permutation(CHAINS)):
            at = body + 2 * query
            tokens[row, at] = QUERY_0 + names[chain, HOPS]
            tokens[row, at + 1] = VALUE_0 + values[chain]
            answers[row, at + 1] = True
    return tokens, answers


TASK = Task(
    name="variables",
    vocab_size=VALUE_0 + VALUES,
    min_length=CHAINS * (1 + HOPS) + 2 * CHAINS,
    max_length=1 << 20,
    summary="two chains `a=v, b=a, c=b` among filler, then `c?`: the value two copies back",
    make=make,
    stationary=False,
)
