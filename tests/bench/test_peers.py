"""bench.peers: with no peer engine installed it says so and succeeds; a named engine that is
not installed is a usage error. (With vLLM or llama.cpp installed it runs them: by hand.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import burst, installed_engines, llama_cpp_command, request_body, vllm_command
from tests.bench.test_http import FakeServer, against

REPO = Path(__file__).parents[2]


def run_peers(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "bench.peers", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(bool(installed_engines()), reason="a peer engine is installed here")
def test_with_no_peer_installed_it_says_so_and_exits_0() -> None:
    result = run_peers()
    assert result.returncode == 0, result.stderr
    assert "neither vLLM nor llama.cpp is installed" in result.stdout
    assert "nothing to compare" in result.stdout


@pytest.mark.skipif("vllm" in installed_engines(), reason="vLLM is installed here")
def test_an_engine_named_but_not_installed_is_a_usage_error() -> None:
    result = run_peers("--engines", "vllm")
    assert result.returncode == 2
    assert "not installed: vllm" in result.stderr


def test_the_peers_serve_the_export_in_float32_at_ordinals_context() -> None:
    vllm = vllm_command(Path("hf"), 8123, 512, tensor_parallel=2)
    assert vllm[vllm.index("--model") + 1] == "hf"
    assert vllm[vllm.index("--dtype") + 1] == "float32"
    assert vllm[vllm.index("--max-model-len") + 1] == "512"
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "2"
    llama = llama_cpp_command(Path("rope.gguf"), 8123, 512)
    assert "rope.gguf" in llama and "8123" in llama and "512" in llama


def test_the_load_table_gives_ordinals_ratio_to_each_peer() -> None:
    from bench.run import peers_section

    def figures(rate: float, ttft: float, gap: float) -> dict:
        return {"tokens_per_s": rate, "ttft_ms_p99": ttft, "gap_ms_p99": gap}

    medians = {
        "1 stream × 256": {"ordinal": figures(1500, 5, 1), "llama.cpp": figures(1000, 4, 1)},
        "32 streams × 128": {
            "ordinal": figures(6000, 120, 30),
            "ordinal, stream interval 0": figures(5800, 118, 16),
            "llama.cpp": figures(2000, 240, 20),
        },
    }
    load = {
        "medians": medians, "engines": ["llama.cpp"], "command": "python -m bench.peers --load",
        "date": "2026-12-02 06:00", "load_average_at_start": 0.5, "rounds": 5,
        "loads": [{"label": label} for label in medians], "cpu": "Some CPU 9000",
    }  # fmt: skip
    section = peers_section(load)
    assert "2026-12-02 06:00, Some CPU 9000, load average" in section  # the host it ran on
    rows = {line.split(" | ")[0]: line for line in section.splitlines()}
    assert "1,000 (ordinal 1.50×)" in rows["| 1 stream × 256, tokens/s"]
    assert "2,000 (ordinal 3.00×)" in rows["| 32 streams × 128, tokens/s"]
    assert "240.0 (ordinal 0.50×)" in rows["| time to first token p99, 32 streams × 128, ms"]
    gap = rows["| inter-token gap p99, 32 streams × 128, ms (ordinal `--stream-interval 0`)"]
    assert "| 16.0 | 20.0 (ordinal 0.80×)" in gap  # from the stream-interval-0 server


def test_the_recorded_command_names_the_llama_server_it_found(monkeypatch) -> None:
    """The C++ llama-server and llama-cpp-python's server differ (one request at a time): the
    table's command says which one PATH held."""
    import bench.peers as peers

    monkeypatch.setattr(peers.sys, "argv", ["peers.py", "--load", "--rounds", "5"])
    monkeypatch.setattr(peers.shutil, "which", lambda name: f"/opt/llama/{name}")
    found = peers.reproducing_command(["vllm", "llama.cpp"])
    assert found == "PATH=/opt/llama:$PATH python -m bench.peers --load --rounds 5"
    monkeypatch.setattr(peers.shutil, "which", lambda name: None)
    assert peers.reproducing_command(["llama.cpp"]) == "python -m bench.peers --load --rounds 5"


@pytest.mark.parametrize("engine", ["ordinal", "vllm", "llama.cpp"])
def test_a_burst_counts_each_streams_tokens_from_its_usage(engine: str) -> None:
    """ordinal sends the tokens that travel together as one chunk: a burst counts the usage
    chunk's tokens, which every engine is asked for, not the chunks."""
    body = request_body(engine, 3, {})
    assert body["stream_options"] == {"include_usage": True}
    joined = (
        b'data: {"choices": [{"text": "ab"}]}\n\n'
        + b'data: {"choices": [{"text": "c"}]}\n\n'
        + b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n'
        + b"data: [DONE]\n\n"
    )
    result = against(FakeServer(events=joined), lambda url: burst(url, 4, body))
    assert result["tokens"] == 4 * 3
