"""bench/train.py times ``ordinal train``'s own steps (here the tiny preset's, in seconds): its
tokens/s is the preset's tokens per step over the timed steps' wall time, and ``--profile``
finds the phases lab.train labels. The figures themselves are never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lab.train
from bench.train import main
from lab.corpus import Corpus, load_corpus
from model.config import PRESETS


def test_the_bench_times_the_presets_own_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = load_corpus()
    small = Corpus(train=full.train[:300], validation=full.validation[:10])
    monkeypatch.setattr(lab.train, "load_corpus", lambda: small)
    out = tmp_path / "train.json"
    argv = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--profile"]
    result = main([*argv, "--tokenizer", str(tmp_path / "tok.json"), "--out", str(out)])

    tiny = PRESETS["tiny"]
    tokens = tiny.train.batch_size * tiny.train.grad_accum * tiny.model["context_length"]
    assert result["tokens_per_step"] == tokens
    assert len(result["step_seconds"]) == 2
    assert result["tokens_per_second"] == pytest.approx(2 * tokens / sum(result["step_seconds"]))
    shares = result["phase_shares"]
    assert {"batch", "forward", "backward", "clip", "Optimizer.step#AdamW.step"} <= set(shares)
    assert 0.5 < sum(shares.values()) <= 1.0 + 1e-6  # disjoint phases of the profiled time
    assert json.loads(out.read_text()) == result

    with pytest.raises(SystemExit, match="6 steps"):
        main(["--preset", "tiny", "--steps", "6", "--tokenizer", str(tmp_path / "tok.json")])
