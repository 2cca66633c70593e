"""bench.peers: with no peer engine installed it says so and succeeds; a named engine that is
not installed is a usage error. (With vLLM or llama.cpp installed it runs them: by hand.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import installed_engines, llama_cpp_command, vllm_command

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
