#!/usr/bin/env bash
# The checks a CUDA machine is for, in one run: the GPU's tests (every scheme's steps replayed
# from CUDA graphs decode as the ordinary ones; seeded sampling), then the in-process and HTTP
# benchmarks in bfloat16 and their report. Everything lands in $1 (default bench/results-cuda);
# each part is time-boxed so that a failing one leaves the others' figures.
#
#     bench/cuda.sh /tmp/cuda-results        # PYTHON=... to choose the interpreter
set -u
out=${1:-bench/results-cuda}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
"$python" -c "import torch; print(torch.__version__, torch.version.cuda)" >>"$out/gpu.txt" 2>&1

timeout "${TESTS_SECONDS:-150}" "$python" -m pytest -q -p no:cacheprovider \
    tests/model/test_captured.py tests/model/test_sampling.py tests/model/test_positional.py \
    -k "cuda or gpu or device" 2>&1 | tail -40 >"$out/tests.txt"

# decode: every scheme, CUDA graphs on and off; http: the server at its defaults. Two runs, so
# that one stopping (a timeout, a CUDA error) leaves the other's figures.
timeout "${DECODE_SECONDS:-240}" "$python" -m bench.run --stages decode --repeats "${REPEATS:-2}" \
    --results "$out" --doc "$out/benchmarks.md" ${SCHEMES:+--schemes $SCHEMES} 2>&1 |
    tail -40 >"$out/decode.txt"
timeout "${HTTP_SECONDS:-200}" "$python" -m bench.run --stages http --min-seconds "${MIN_SECONDS:-5}" \
    --min-rounds 1 --results "$out" --doc "$out/benchmarks.md" 2>&1 | tail -40 >"$out/http.txt"
# Rendered again from what was written, in case the run above stopped part-way.
"$python" -m bench.run --stages --results "$out" --doc "$out/benchmarks.md" >>"$out/http.txt" 2>&1
ls -la "$out"
