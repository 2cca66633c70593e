"""Work that is not decoding cannot stall the streams decoding: a flood of traces (run in the
engine's loop, a prefill chunk's worth a turn, at most ``max_traces`` per model, 429 past it),
a 1 MB prompt (tokenised off the API's event loop, in a lane apart from short texts, and
refused by its size before), and template bombs (a bounded sandbox). Each stream's waits are
measured by the client: for its first token, and between its chunks."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from server.api import offload
from tests.server.conftest import Running

STREAMS = 8
GAP_P99 = 0.100  # seconds: the most a stream's p99 inter-token gap may be
STREAM = {"prompt": "To be", "max_tokens": 100, "ignore_eos": True, "stream": True, "seed": 1}


def stream_gaps(
    url: str, body: dict[str, Any], started: threading.Barrier
) -> tuple[list[float], int]:
    """The seconds each token chunk of one streamed completion waited (the first since the
    request was sent, each later one since the chunk before), and its tokens. A chunk may carry
    several tokens that arrived together: a stall of the API's event loop as long as the whole
    stream leaves one chunk, and then only the first wait shows it."""
    arrivals: list[float] = []
    tokens = 0
    body = {**body, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, timeout=60) as client:
        started.wait()
        arrivals.append(time.monotonic())
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    assert '"error"' not in line, line
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk["choices"]:
                        arrivals.append(time.monotonic())
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    return list(np.diff(arrivals)), tokens


def gaps_beside(
    url: str, attack: Callable[[threading.Event], None], attackers: int
) -> tuple[np.ndarray, int]:
    """Every inter-token gap of STREAMS streams run while ``attackers`` threads run ``attack``
    (until the event is set); also the number of tokens the streams received."""
    stop = threading.Event()
    started = threading.Barrier(STREAMS + 1)
    threads = [threading.Thread(target=attack, args=(stop,)) for _ in range(attackers)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # the attack is under way before the streams start
    results: list[tuple[list[float], int]] = [([], 0) for _ in range(STREAMS)]

    def run(index: int) -> None:
        results[index] = stream_gaps(url, {**STREAM, "seed": index}, started)

    streams = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for thread in streams:
        thread.start()
    started.wait()
    for thread in streams:
        thread.join(60)
    stop.set()
    for thread in threads:
        thread.join(60)
    gaps = np.array([gap for result, _ in results for gap in result])
    return gaps, sum(tokens for _, tokens in results)


def test_a_trace_flood_leaves_eight_streams_their_pace(server: Running) -> None:
    statuses: Counter[int] = Counter()
    longest = {"prompt": [5] * 127, "attention": True, "model": "rope"}  # 128 with <|bos|>

    def flood(stop: threading.Event) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            deadline = time.monotonic() + 30
            while not stop.is_set() and time.monotonic() < deadline:
                response = client.post("/v1/trace", json=longest)
                statuses[response.status_code] += 1
                if response.status_code == 429:  # retry when told to, as clients do
                    stop.wait(float(response.headers["retry-after"]))

    gaps, tokens = gaps_beside(server.url, flood, attackers=20)
    assert tokens == STREAMS * STREAM["max_tokens"]
    assert statuses[200] >= 20  # the traces ran beside the streams...
    assert statuses[429] > 0  # ...at most max_traces (4) of them queued at once
    assert set(statuses) == {200, 429}
    assert np.percentile(gaps, 99) < GAP_P99, f"p99 {np.percentile(gaps, 99):.3f} s"


MEGABYTE_PROMPT = "To be, or not to be, that is the question. " * 23_000  # 989,000 bytes


def test_megabyte_prompts_leave_the_streams_their_pace(server: Running) -> None:
    statuses: Counter[tuple[str, int]] = Counter()

    def send(stop: threading.Event) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for path in ("/v1/completions", "/v1/tokenize") * 2:
                if stop.is_set():
                    return
                response = client.post(path, json={"prompt": MEGABYTE_PROMPT})
                statuses[path, response.status_code] += 1
                if path == "/v1/completions":  # refused before it is tokenised
                    error = response.json()["error"]
                    assert error["code"] == "context_length_exceeded", error
                else:  # tokenised, off the event loop
                    assert response.json()["count"] > 100_000

    gaps, tokens = gaps_beside(server.url, send, attackers=4)
    assert tokens == STREAMS * STREAM["max_tokens"]
    assert gaps.max() < 0.5, f"a stall of {gaps.max():.2f} s"  # encode() held the GIL 1.6 s
    assert statuses[("/v1/completions", 400)] >= 4 and statuses[("/v1/tokenize", 200)] >= 1
    assert np.percentile(gaps, 99) < GAP_P99, f"p99 {np.percentile(gaps, 99):.3f} s"


def test_a_short_prompt_and_a_chat_never_wait_for_the_long_texts_thread(server: Running) -> None:
    """While the thread that tokenises long texts is held (a 1 MB text holds it half a second),
    a short prompt is tokenised and a chat's scene made, each in a thread of its own."""
    release = threading.Event()
    held = offload.POOL.submit(release.wait)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            completion = client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2})
            messages = [{"role": "user", "content": "Good morrow, cousin.", "name": "Benvolio"}]
            chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    finally:
        release.set()
        held.result(10)
    assert completion.status_code == 200, completion.text
    assert chat.status_code == 200, chat.text
    assert completion.json()["usage"]["completion_tokens"] == 2
    assert chat.json()["usage"]["completion_tokens"] == 2
