"""Checkpoints that would take the engine down fail alone: a weights file larger than memory,
a header claiming huge tensors, a config with 10,000 layers, and a checkpoint whose loading
kills the engine process (as the OOM killer does). The files are sparse: they claim tens of GB
and hold none of it."""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from pathlib import Path

import httpx
import pytest

from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, available_memory, expected_shapes
from model.config import ModelConfig
from tests.server.conftest import running_server, test_settings

GiB = 2**30


def sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> int:
    """A float32 safetensors file whose header declares ``shapes`` and whose data section is a
    hole of the right size (no disk blocks); returns the file's size."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        size = 4 * math.prod(shapes[name])
        header[name] = {
            "dtype": "F32",
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)
    return 8 + len(encoded) + offset


def copy_with_config(source: Path, target: Path, **changes: object) -> ModelConfig:
    shutil.copytree(source, target)
    config = ModelConfig.load(source / CONFIG_FILE).replace(**changes)
    config.save(target / CONFIG_FILE)
    return config


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_checkpoints_that_would_take_the_engine_down_fail_alone(
    checkpoints: Path, tmp_path: Path
) -> None:
    memory = available_memory()
    if memory is None:
        pytest.skip("needs Linux's MemAvailable")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    rope = checkpoints / "rope"
    shutil.copytree(rope, folder / "rope")
    # Larger than memory: a config whose weights need twice what is available, and a file
    # that holds exactly those tensors.
    base = ModelConfig.load(rope / CONFIG_FILE)
    per_layer = sum(
        4 * math.prod(shape)
        for name, shape in expected_shapes(base.replace(d_model=4096, d_ff=8192)).items()
        if name.startswith("blocks.0.")
    )
    layers = math.ceil(2 * memory / per_layer)
    huge = copy_with_config(rope, folder / "huge", d_model=4096, d_ff=8192, n_layers=layers)
    huge_size = sparse_safetensors(folder / "huge" / WEIGHTS_FILE, expected_shapes(huge))
    # A header claiming a 64 GB embedding for a tiny config.
    claims = copy_with_config(rope, folder / "claims")
    shapes = {**expected_shapes(claims), "token_embedding.weight": (2**29, 32)}
    claims_size = sparse_safetensors(folder / "claims" / WEIGHTS_FILE, shapes)
    # 10,000 layers in the config, two in the file.
    copy_with_config(rope, folder / "layers", n_layers=10_000)
    shutil.copytree(rope, folder / "crashes")

    settings = test_settings(folder)
    started = time.monotonic()
    with running_server(settings, crash_loading="crashes") as running:
        took = time.monotonic() - started
        engine = running.service.engine
        assert engine is not None and engine.pid is not None
        health = httpx.get(f"{running.url}/health").json()
        states = {name: model["state"] for name, model in health["models"].items()}
        assert states == {
            "rope": "ready",
            "huge": "failed",
            "claims": "failed",
            "layers": "failed",
            "crashes": "failed",
        }
        messages = {name: model.get("message", "") for name, model in health["models"].items()}
        assert "GiB of memory is available" in messages["huge"]
        assert "but the tensors of its config take" in messages["claims"]
        assert "is missing" in messages["layers"]
        assert "died while loading it" in messages["crashes"]
        assert "not loaded again" in messages["crashes"]
        # The crashing checkpoint was tried once: the second engine did not load it.
        pid = engine.pid
        time.sleep(1.0)
        assert engine.pid == pid and running.service.ready
        assert len((folder / "attempts").read_text().splitlines()) == 1
        # The engine that refused the big files never held them.
        assert peak_rss(pid) < min(huge_size, claims_size) / 8
        assert huge_size > memory and claims_size > 60 * GiB
        assert took < 60
        body = {"model": "rope", "prompt": "To be", "max_tokens": 3}
        assert httpx.post(f"{running.url}/v1/completions", json=body).status_code == 200
