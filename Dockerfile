# The ordinal server, CPU build by default. Checkpoints are not baked in: mount them at
# /app/checkpoints (docker-compose.yml does, read-only).
#
#   docker build -t ordinal .
#   docker run -p 8000:8000 -v "$PWD/checkpoints:/app/checkpoints:ro" ordinal
#
# For a CUDA build take torch from PyPI, whose Linux wheels bundle the CUDA runtime:
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t ordinal:cuda .
#
# Two stages: `kernels` compiles the C++ kernels (model/kernels) with g++, every variant of the
# architecture (on x86-64: avx512, avx2, scalar), and the final image takes the libraries
# without the compiler. It runs the fastest variant the CPU it lands on has, whatever CPU built
# it; tests/test_deploy.py runs these steps in a clean folder and checks the kernel decodes.
FROM python:3.11-slim AS base

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_EXTENSIONS_DIR=/opt/ordinal/kernels

WORKDIR /app

# torch on its own layer, before the code: it is by far the largest download, and the default
# PyPI wheel would bring several GB of CUDA libraries that a CPU image never uses.
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"

# Only what `pip install .` needs; tests, runs and checkpoints stay out of the image.
COPY pyproject.toml README.md ordinal.py ./
COPY model ./model
COPY lab ./lab
COPY interop ./interop
COPY server ./server
COPY clients ./clients
RUN pip install .

FROM base AS kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m model.kernels --all

FROM base
# The kernels' OpenMP runtime (their only library beyond torch's own).
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=kernels /opt/ordinal/kernels /opt/ordinal/kernels

RUN useradd --create-home --uid 10001 ordinal
USER ordinal

ENV ORDINAL_CHECKPOINTS=/app/checkpoints
EXPOSE 8000

# The slim image has no curl; urlopen raises (so python exits non-zero) on any non-2xx answer.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('ORDINAL_PORT', '8000') + '/health', timeout=4)"

CMD ["ordinal", "serve", "--host", "0.0.0.0"]
