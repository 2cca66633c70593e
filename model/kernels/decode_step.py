"""A decode step, from the new tokens' ids to their logits, in one C++ call on a CPU.

A decode step's blocks are ~40 torch operations each — a norm, three projections, a rotation,
a cache write, attention, an MLP — on a few hundred floats per row, so at batch 1 the step was
Python and dispatch, not arithmetic: 93% of a single stream's engine time was the forward
(docs/performance.md). ``decode_step.cpp`` runs the step's arithmetic in one call, with
``linear_core.h``'s projections (a row's numbers the same alone and in any batch): the
embedding lookup, the blocks, the final norm and the logits. The lookup and the head are in it
too because a step streams megabytes of weights through the CPU's caches, after which each
small torch operation runs cold, several times slower (docs/performance.md).

The torch forward stays the definition, and the model still computes the scheme's position
vectors, rotation tables and score bias in torch. It applies to a cached pass of one token per
pass row — a decode step's rows, and the prompt tokens that ride the step (several consecutive
pass rows filling one cache row, each attending what the ones before it stored), so a short
prompt costs a few more rows of a pass the weights stream through anyway — without gradients,
in float32 on a CPU with kernels built, for a scheme whose signal is a vector, a rotation or a
bias (fox's and cope's, which come from each layer's own tensors, are computed in the kernel),
without QK-norm, and for at most :data:`MAX_ROWS` pass rows a call; anything else runs the
torch blocks. Tests hold the two equal for every scheme and architecture
(tests/model/kernels/test_decode_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from model.kernels import decoding_on_cpu, ops
from model.kernels.linear import packed, version_of

if TYPE_CHECKING:
    from model.cache import CacheWrite, KVCache
    from model.positional.rotation import Rotation
    from model.transformer import Block, Transformer

MAX_ROWS = 64  # as the projection kernel's: past it MKL's GEMM is as fast
EMPTY = torch.empty(0)  # what the kernel reads as "none" (it reads only its size)
NORMS = ("layernorm", "rmsnorm")  # decode_step.cpp's Norm enum, in its order
MLPS = ("gelu", "gelu_tanh", "relu2", "swiglu")  # decode_step.cpp's Mlp enum, in its order


def ready() -> bool:
    """Whether the kernels are built (building them on first call)."""
    return ops() is not None


def parallel_threads() -> int:
    """How many threads the kernels' parallel loops use when called from this thread (1 when
    the kernels are not built). ``torch.get_num_threads()`` need not say: see
    ``server.engine.core.pin_threads``."""
    kernels = ops()
    return 1 if kernels is None else int(kernels.parallel_threads())


ORDERS = {"free": 0, "helper_finishes": 1, "helper_stalls": 2}


def share_large_steps(on: bool, order: str = "free") -> None:
    """Whether a step of eight rows or more (decode_step.cpp's ``kSplitRows``), run on one
    torch thread, shares its attention with the kernel's helper thread (``SharedWork`` there):
    the server's default (``--attention-helper``). The helper takes rows while it has a core, the
    step never waits for it, and a row's numbers are the same bits whichever thread attends it.
    Off until asked for; a no-op without the kernel.

    ``order``: "free" (serving), or for the tests one of the two paths for sure: the helper
    takes the first row and the decode thread waits for its result ("helper_finishes"), or the
    helper takes it and stalls while the decode thread computes it itself ("helper_stalls")."""
    if (kernels := ops()) is not None:
        kernels.share_large_steps(on, ORDERS[order])


def shares_large_steps() -> bool:
    """Whether large steps share their attention now (:func:`share_large_steps`)."""
    kernels = ops()
    return kernels is not None and bool(kernels.shares_large_steps())


def shared_rows() -> tuple[int, int]:
    """Rows of shared attention in this process so far: (whose result the helper supplied,
    which the helper took and the decode thread computed instead); (0, 0) without the kernel."""
    if (kernels := ops()) is None:
        return 0, 0
    helped, taken = kernels.shared_rows()
    return int(helped), int(taken)


def applies(model: Transformer, tokens: Tensor) -> bool:
    """Whether a cached pass over ``tokens`` [B, T] runs here: the model's decode backend is the
    kernel (``model.backend``, chosen once), and this pass is a decode pass of at most MAX_ROWS
    rows of one token each, without gradients."""
    return (
        tokens.shape[1] == 1
        and tokens.shape[0] <= MAX_ROWS
        and tokens.dtype is torch.long
        and tokens.is_cpu
        and not model.training
        and decoding_on_cpu(model.lm_head.weight)
        and model.decode_backend == "cpu-kernel"
    )


def run_step(
    model: Transformer,
    tokens: Tensor,
    position_vectors: Tensor | None,
    cache: KVCache,
    plan: CacheWrite,
    rotation: Rotation | None,
    bias: Tensor | None,
    logit_rows: Tensor | None = None,
) -> Tensor:
    """A cached one-token pass: ``tokens`` [B, 1] → logits [B, vocab], each row's key and value
    written into ``cache`` at its cache row and position (``plan``: its rows in order, or
    ``plan.slot_rows``, where a prompt's tokens may share one). ``position_vectors``: the
    scheme's [B|1, 1, d] or None; ``rotation``: cos/sin [B, 1, 1, rot] or None; ``bias``: the
    scheme's score bias [B|1, H, 1, Tk] or None. ``logit_rows`` [k] int64: only those rows'
    logits → [k, vocab] (None: every row's)."""
    kernels = ops()
    assert kernels is not None, "check applies() first"
    rows = tokens.shape[0]
    slot_rows = plan.slot_rows
    if slot_rows is None:
        first_row, _, step = plan.rows.indices(cache.keys.shape[1])
        assert step == 1, "a decode step's rows are consecutive"
        slot_rows = torch.arange(first_row, first_row + rows)
    own = model.positional.kernel_tensors(cache)
    kept = _kept_step_tensors(model)
    blocks, head, architecture, eps = kept.blocks, kept.head, kept.architecture, kept.eps
    return cast(
        Tensor,
        kernels.decode_step(
            tokens,
            slot_rows,
            plan.positions,
            [cache.keys, cache.values, own.states],
            model.token_embedding.weight,
            _signal(rows, position_vectors, rotation, bias),
            blocks,
            head,
            [own.gate_weight, own.gate_bias, own.table],
            architecture,
            eps,
            logit_rows,
        ),
    )


def _signal(
    rows: int, position_vectors: Tensor | None, rotation: Rotation | None, bias: Tensor | None
) -> list[Tensor]:
    """The scheme's signal as the kernel reads it: position vectors [rows, d], cos and sin
    [rows, rot], the score bias [rows, H, Tk] (float32; empty where the scheme has none)."""
    vectors = cos = sin = flat_bias = EMPTY
    if position_vectors is not None:
        vectors = position_vectors.float().expand(rows, 1, -1).reshape(rows, -1).contiguous()
    if rotation is not None:
        cos, sin = (table.reshape(rows, -1).float() for table in rotation)
    if bias is not None:
        flat_bias = bias.float().expand(rows, -1, -1, -1)[:, :, 0]  # [B, H, Tk]
    return [vectors, cos, sin, flat_bias]


def _architecture(model: Transformer) -> tuple[list[int], float]:
    """The kernel's architecture list (vocab, heads, kv_heads, norm, mlp, the scheme's bias:
    decode_step.cpp's enums) and the norms' epsilon."""
    config, scheme = model.config, model.positional
    assert scheme.kernel_bias is not None, "the backend is the kernel: the scheme declares its bias"
    first_norm = cast("list[Block]", model.blocks)[0].attention_norm
    norm_eps = cast("nn.LayerNorm | nn.RMSNorm", first_norm).eps
    eps = torch.finfo(torch.float32).eps if norm_eps is None else norm_eps  # RMSNorm's default
    architecture = [
        model.lm_head.weight.shape[0],
        config.n_heads,
        config.key_value_heads,
        NORMS.index(config.norm),
        MLPS.index(config.mlp),
        int(scheme.kernel_bias),
    ]
    return architecture, eps


# Bumped whenever any module anywhere registers a parameter or a submodule (an assignment such as
# ``linear.weight = Parameter(...)``, ``load_state_dict(assign=True)``, a replaced layer): a
# model's kept step tensors are then gathered again. In-place changes and new data under a
# parameter are caught by the projection weights' version_of (see step_tensors).
_structure = [0]


def _structure_changed(*_: object) -> None:
    _structure[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_structure_changed)
nn.modules.module.register_module_module_registration_hook(_structure_changed)


def step_tensors(model: Transformer) -> tuple[list[Tensor], list[Tensor]]:
    """The kernel's tensors: each block's 12 in its order (an absent bias as an empty tensor) —
    attention norm weight and bias, QKV weight and bias, output projection weight and bias, MLP
    norm weight and bias, up weight and bias, down weight and bias — and the head's 4: the final
    norm's weight and bias, the logits projection's weight and bias. The parameters themselves,
    a projection's weight as :func:`~model.kernels.linear.packed` lays it out for the kernel.

    Kept on the model between steps (gathering them was a noticeable share of a batch-1 step at
    4L-256d) and gathered again when a parameter or module was assigned anywhere (the hooks
    above) or a projection weight's :func:`~model.kernels.linear.version_of` changed (the
    packed copy must follow). A norm's parameters and the biases are passed as themselves,
    so their changes need no check."""
    kept = _kept_step_tensors(model)
    return kept.blocks, kept.head


def _kept_step_tensors(model: Transformer) -> _StepTensors:
    """step_tensors's kept gathering (with the architecture list), gathered again if stale."""
    kept: _StepTensors | None = model.__dict__.get("_ordinal_step_tensors")
    if (
        kept is not None
        and kept.structure == _structure[0]
        and kept.versions == [version_of(weight) for weight in kept.weights]
    ):
        return kept
    kept = _gather(model)
    model.__dict__["_ordinal_step_tensors"] = kept
    return kept


@dataclass
class _StepTensors:
    structure: int  # _structure when gathered
    weights: list[Tensor]  # the projection weights, as parameters
    versions: list[tuple[int | None, int, tuple[int, ...]]]  # each one's version_of when gathered
    blocks: list[Tensor]
    head: list[Tensor]
    architecture: list[int]  # _architecture's, with eps: the config's, read once
    eps: float


def _gather(model: Transformer) -> _StepTensors:
    empty = EMPTY
    structure = _structure[0]
    weights: list[Tensor] = []

    def pair(module: nn.Module) -> list[Tensor]:
        weight, bias = cast(Tensor, module.weight), getattr(module, "bias", None)
        if isinstance(module, nn.Linear):
            weights.append(weight)
            weight = packed(weight)  # in contiguous blocks; bfloat16 where that is exact
        return [weight, empty if bias is None else bias]

    blocks: list[Tensor] = []
    for block in cast("list[Block]", model.blocks):
        for module in (
            block.attention_norm,
            block.attention.qkv,
            block.attention.proj,
            block.mlp_norm,
            block.mlp.up,
            block.mlp.down,
        ):
            blocks += pair(module)
    head = pair(model.final_norm) + pair(model.lm_head)
    versions = [version_of(weight) for weight in weights]
    architecture, eps = _architecture(model)
    return _StepTensors(structure, weights, versions, blocks, head, architecture, eps)
