"""Checkpoints that would take the engine down fail alone: a weights file larger than memory,
a header claiming huge tensors, a config with 10,000 layers, and a checkpoint whose loading
kills the engine process (as the OOM killer does). The files are sparse: they claim tens of GB
and hold none of it. A checkpoint larger than the container's memory limit (its cgroup's) is
refused as one larger than the machine's, and a tokenizer of a million added tokens is refused
unread while a stream runs beside it."""

from __future__ import annotations

import json
import math
import shutil
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest

from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, expected_shapes
from model.config import ModelConfig
from model.memory import available_memory
from tests.server.conftest import running_server, test_settings, wait_for

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


CGROUP_CHECKPOINT_BYTES = 10 * 10**9  # the attack's size: 10 GB, a sparse file


def fake_cgroup(folder: Path, limit: int, used: int) -> tuple[Path, Path]:
    """A cgroup v2 hierarchy of files whose group ``/ordinal`` may use ``limit`` bytes and uses
    ``used``; and the ``/proc/self/cgroup`` that puts a process there. → (root, that file)"""
    root = folder / "cgroup"
    group = root / "ordinal"
    group.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (group / "memory.max").write_text(f"{limit}\n")
    (group / "memory.current").write_text(f"{used}\n")
    (group / "memory.stat").write_text("anon 400000000\ninactive_file 0\n")
    (folder / "proc-self-cgroup").write_text("0::/ordinal\n")
    return root, folder / "proc-self-cgroup"


def test_a_checkpoint_over_the_cgroup_limit_is_refused_before_loading(
    checkpoints: Path, tmp_path: Path
) -> None:
    """A 10 GB sparse checkpoint (its header matches its config) beside rope, under a 3 GiB
    cgroup limit on a machine with more free memory than that: it was loaded, the engine
    OOM-killed and restarted (/health 200 only 73% of the time, two engine processes). The
    cgroup's files are faked in the engine process (``engine_control``): a real group cannot be
    made here without moving processes out of the one this machine's tooling tracks them in.
    Now it is refused before it is read, naming the cgroup's limit; /health stays 200 from the
    moment rope serves, and the one engine process never restarts."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    rope = checkpoints / "rope"
    shutil.copytree(rope, folder / "rope")
    base = ModelConfig.load(rope / CONFIG_FILE)
    wide = base.replace(d_model=4096, d_ff=8192)
    per_layer = sum(
        4 * math.prod(shape)
        for name, shape in expected_shapes(wide).items()
        if name.startswith("blocks.0.")
    )
    huge = copy_with_config(
        rope,
        folder / "huge",
        d_model=4096,
        d_ff=8192,
        n_layers=CGROUP_CHECKPOINT_BYTES // per_layer,
    )
    huge_size = sparse_safetensors(folder / "huge" / WEIGHTS_FILE, expected_shapes(huge))
    root, own_groups = fake_cgroup(tmp_path, limit=3 * GiB, used=GiB // 2)

    with running_server(test_settings(folder), wait_ready=False, hold_loading=True) as running:
        running.control.call("fake_cgroup", str(root), str(own_groups))
        running.control.call("release_loading")
        engine = running.service.engine
        assert engine is not None
        wait_for(lambda: running.service.ready, "rope to serve", timeout=120)
        pid = engine.pid
        statuses = []
        until = None
        while until is None or time.monotonic() < until:
            statuses.append(httpx.get(f"{running.url}/health").status_code)
            if until is None and running.service.settled:
                until = time.monotonic() + 1.0  # and a second more: nothing dies later
        assert set(statuses) == {200}, statuses
        health = httpx.get(f"{running.url}/health").json()
        assert health["models"]["rope"]["state"] == "ready"
        assert health["models"]["huge"]["state"] == "failed"
        message = health["models"]["huge"]["message"]
        assert "2.5 GiB of memory is available under this process's cgroup memory limit" in message
        assert engine.pid == pid == running.control.call("pid") and engine.exitcode is None
        assert peak_rss(pid) < huge_size / 8  # never read
        body = {"model": "rope", "prompt": "To be", "max_tokens": 3}
        assert httpx.post(f"{running.url}/v1/completions", json=body).status_code == 200


ADDED_TOKENS = 1_000_000


def bloat_tokenizer(path: Path, count: int) -> int:
    """Append ``count`` added tokens to the tokenizer.json at ``path``; → its size in bytes."""
    data = json.loads(path.read_text())
    first = len(data["model"]["vocab"]) + len(data["added_tokens"])
    data["added_tokens"] += [
        {
            "id": first + number,
            "content": f"<added {number}>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
        for number in range(count)
    ]
    path.write_text(json.dumps(data))
    return path.stat().st_size


def test_a_tokenizer_of_a_million_added_tokens_is_refused_unread_beside_a_stream(
    checkpoints: Path, tmp_path: Path
) -> None:
    """rope streams while the engine loads a checkpoint whose tokenizer.json holds a million
    added tokens (137 MB) for a model of 300: parsing it held the GIL, so it took 5.5 s to
    refuse while the stream waited 4.4 s for a token. Now it is refused by its size, unread:
    within a second, and no wait between two tokens of the streams reaches one."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    shutil.copytree(checkpoints / "rope", folder / "rope")
    shutil.copytree(checkpoints / "rope", folder / "bloated")
    size = bloat_tokenizer(folder / "bloated" / "tokenizer.json", ADDED_TOKENS)
    assert size > 100 * 10**6

    waits: list[float] = []  # before each stream's first token, and between two tokens
    statuses: list[int] = []
    streaming = threading.Event()
    done = threading.Event()

    def stream() -> None:
        body = {"model": "rope", "prompt": "To be", "max_tokens": 100, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=running.url, timeout=60) as client:
            while not done.is_set():
                last = time.monotonic()
                with client.stream("POST", "/v1/completions", json=body) as response:
                    statuses.append(response.status_code)
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            now = time.monotonic()
                            waits.append(now - last)
                            last = now
                            streaming.set()

    with running_server(test_settings(folder), wait_ready=False, hold_loading=True) as running:
        running.control.call("hold_model", "bloated")
        running.control.call("release_loading")
        wait_for(lambda: running.service.ready, "rope to serve", timeout=120)
        streamer = threading.Thread(target=stream)
        streamer.start()
        try:
            wait_for(streaming.is_set, "the stream's first token")
            released = time.monotonic()
            running.control.call("release_model")
            wait_for(lambda: running.service.settled, "the bloated checkpoint to fail")
            took = time.monotonic() - released
            time.sleep(0.5)
        finally:
            done.set()
            streamer.join(60)
        health = httpx.get(f"{running.url}/health").json()
    assert set(statuses) == {200}
    assert len(waits) > 20 and max(waits) < 1.0, (max(waits), took)
    assert took < 1.0, took
    message = health["models"]["bloated"]["message"]
    assert health["models"]["bloated"]["state"] == "failed"
    assert f"tokenizer.json is {size / 1e6:.1f} MB: more than a tokenizer" in message
