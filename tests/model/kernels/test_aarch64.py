"""The kernels build for aarch64 (ARM NEON: Apple Silicon, Graviton, Ampere): every source
cross-compiled in one unit, as a variant is, with Debian's g++-aarch64-linux-gnu against this
torch's headers, its vectors in NEON registers and its products NEON's fused multiply-adds.
``make test`` installs the cross compiler; without it this test skips, except under CI (``CI``
set), where it fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils import cpp_extension

import model.kernels as kernels

CROSS = "aarch64-linux-gnu-g++"


def test_the_kernels_compile_for_aarch64_with_neon(tmp_path: Path) -> None:
    compiler = shutil.which(CROSS)
    assembler = shutil.which("aarch64-linux-gnu-as")
    if compiler is None or assembler is None:
        if os.environ.get("CI"):
            pytest.fail(f"{CROSS} is not installed (CI is set: `make test` installs it)")
        pytest.skip(f"{CROSS} is not installed: `make cross` installs it")
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    assembly = tmp_path / "unity.s"
    # The variant's flags at -O1: the check is that the source compiles for aarch64 and that
    # simd.h's fused multiply-add is NEON's (an intrinsic, at any level); -O3 takes far longer.
    flags = [flag if flag != "-O3" else "-O1" for flag in kernels.flags("neon")]
    compile_ = [compiler, "-std=c++20", "-fPIC", *flags, *includes]
    result = subprocess.run(
        [*compile_, "-S", str(kernels.unity_source(tmp_path)), "-o", str(assembly)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    text = assembly.read_text()
    assert re.search(r"\tfmla\tv\d+\.4s", text)  # simd::fmadd: NEON's vector multiply-add
    assert "ordinal_neon" in text  # the ops' namespace, for torch.ops.ordinal_neon
    objects = tmp_path / "unity.o"
    subprocess.run([assembler, str(assembly), "-o", str(objects)], check=True)
    header = objects.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # AArch64
