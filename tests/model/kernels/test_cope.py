"""The C++ CoPE kernel (model/kernels/cope.cpp) computes what the torch reference defines
(model/positional/cope.py), forward and backward, on ragged masks, past the table's last row,
in float32 and bfloat16, and registers as an op torch.compile can hold whole."""

from __future__ import annotations

import math

import pytest
import torch

from model.kernels import cope as cope_kernel
from model.positional.cope import contextual_positions, interpolated_logits
from tests.model.conftest import random_model, random_tokens

# Every variant this CPU runs (tests/conftest.py); a kernel that fails to build fails here.
pytestmark = pytest.mark.usefixtures("every_isa")


NAMES = ["bias", "d_q", "d_k", "d_table"]  # what gradients returns, in order


def inputs(
    batch: int, heads: int, queries: int, keys: int, head_dim: int, rows: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys, a table and a ragged mask: each query sees a random four fifths of the keys
    up to its own (so blocks of queries hide their last keys from all of them)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, head_dim, generator=generator) * 2
    k = torch.randn(batch, heads, keys, head_dim, generator=generator) * 2
    table = torch.randn(rows, head_dim, generator=generator)
    offset = keys - queries  # query i sits at key offset + i (a cached chunk)
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(offset)
    allowed = causal & (torch.rand(batch, 1, queries, keys, generator=generator) > 0.2)
    return q, k, table, allowed


def gradients(bias_of, q, k, table, grad) -> list[torch.Tensor]:
    """(bias, d_q, d_k, d_table) in float32 of ``bias_of(q, k, table)``, given ``grad``."""
    q_, k_, t_ = (x.detach().clone().requires_grad_() for x in (q, k, table))
    bias = bias_of(q_, k_, t_)
    bias.backward(grad.to(bias.dtype))
    return [x.detach().float() for x in (bias, q_.grad, k_.grad, t_.grad)]


def reference_gradients(q, k, table, allowed, grad) -> list[torch.Tensor]:
    """The definition's, in float32."""
    return gradients(
        lambda q, k, t: interpolated_logits(q, t, contextual_positions(q, k, allowed)),
        q,
        k,
        table,
        grad,
    )


def kernel_gradients(q, k, table, allowed, grad, dtype=torch.float32, round_inputs=False):
    """The kernel's, run in ``dtype`` (with ``round_inputs``: in float32 on scores and rows
    rounded as bfloat16 rounds them)."""

    def bias_of(q, k, t):
        scores, rows = q.to(dtype) @ k.to(dtype).transpose(-2, -1), q.to(dtype) @ t.T.to(dtype)
        if round_inputs:
            scores, rows = scores.bfloat16().float(), rows.bfloat16().float()
        return cope_kernel.cope_bias(scores, allowed, rows, 1 / math.sqrt(q.shape[-1]))

    return gradients(bias_of, q, k, table, grad)


@pytest.mark.parametrize(
    ("queries", "keys", "rows"),
    [(40, 40, 8), (21, 29, 64), (1, 33, 12)],  # clamped at the last row; a cached chunk; one step
)
def test_the_kernel_equals_the_reference_forward_and_backward(queries, keys, rows) -> None:
    q, k, table, allowed = inputs(2, 3, queries, keys, 8, rows, seed=queries)
    grad = torch.randn(2, 3, queries, keys, generator=torch.Generator().manual_seed(1))
    reference = reference_gradients(q, k, table, allowed, grad)
    kernel = kernel_gradients(q, k, table, allowed, grad)
    if rows == 8:  # positions ran past the table: the clamp was exercised
        assert float(contextual_positions(q, k, allowed).max()) > rows
    for name, expected, got in zip(NAMES, reference, kernel, strict=True):
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4, msg=name)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected))


def test_in_bfloat16_only_the_inputs_rounding_differs() -> None:
    """Training's dtype: scores and rows arrive in bfloat16, gates and positions are counted in
    float32. The bias and the table's gradient stay within 1% of the float32 reference; the
    queries' and keys' gradients move more (a position rounded across an integer reads another
    pair of rows, and the scan carries that to every later key), and all four are what the
    float32 kernel gives for the same rounded inputs."""
    q, k, table, allowed = inputs(2, 2, 48, 48, 16, 32, seed=3)
    q, k, table = q.bfloat16().float(), k.bfloat16().float(), table.bfloat16().float()
    grad = torch.randn(2, 2, 48, 48, generator=torch.Generator().manual_seed(2))
    reference = reference_gradients(q, k, table, allowed, grad)
    in_bfloat16 = kernel_gradients(q, k, table, allowed, grad, torch.bfloat16)
    rounded = kernel_gradients(q, k, table, allowed, grad, round_inputs=True)
    assert relative_error(in_bfloat16[0], reference[0]) < 0.01  # the bias
    assert relative_error(in_bfloat16[3], reference[3]) < 0.01  # the table's gradient
    for name, expected, got in zip(NAMES, rounded, in_bfloat16, strict=True):
        assert relative_error(got, expected) < 0.01, name


def test_the_op_is_registered_for_torch_compile() -> None:
    """torch.library's own checks: the fake (shape) version, the schema and the gradient."""
    q, k, table, allowed = inputs(1, 2, 20, 20, 8, 16, seed=4)
    scores, rows = q @ k.transpose(-2, -1), q @ table.T
    args = (scores.requires_grad_(), allowed, rows.requires_grad_(), 1 / math.sqrt(8))
    torch.library.opcheck(cope_kernel.cope_bias, args)


def test_a_cope_model_trains_through_the_kernel_to_the_reference_gradients(monkeypatch) -> None:
    """The whole model: loss and every gradient agree with the kernel on and off."""
    tokens = random_tokens(3, 24, seed=5)

    def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = random_model("cope", seed=6).train()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        return loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    monkeypatch.setattr(cope_kernel, "available", lambda: False)
    reference_loss, reference_grads = loss_and_grads()
    torch.testing.assert_close(loss, reference_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == reference_grads.keys() and "positional.table" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize(("queries", "keys"), [(1, 37), (1, 1), (9, 30), (20, 20)])
def test_the_decode_path_equals_the_reference_on_cache_views(queries: int, keys: int) -> None:
    """A pass without gradients (decoding) takes its scores and rows from the kernel itself,
    reading queries and keys where the model leaves them (strided views of qkv and the cache)."""
    q, k, table, allowed = inputs(3, 4, queries, keys, 8, 12, seed=keys)
    padded = torch.zeros(3, 4, keys + 5, 8)  # keys as a view into a longer cache
    padded[:, :, :keys] = k
    scale = 1 / math.sqrt(8)
    expected = interpolated_logits(q, table, contextual_positions(q, k, allowed))
    got = cope_kernel.decode_bias(
        q.transpose(1, 2).contiguous().transpose(1, 2), padded[:, :, :keys], table, allowed, scale
    )
    seen = allowed.expand_as(expected)
    torch.testing.assert_close(got[seen], expected[seen], rtol=1e-4, atol=1e-4)
