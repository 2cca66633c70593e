"""The interface every positional scheme implements, and the error for positions past a table.

A scheme may contribute any of three things, each computed ONCE per forward pass from the
positions and shared by all layers:

(a) ``embedding(positions)``: a vector added to the token embeddings (absolute schemes);
(b) ``rotation(positions)``: cos/sin tables that rotate queries and keys (rope);
(c) ``attention_bias(q_positions, k_positions)``: an additive bias on attention scores (alibi,
    t5, fire).

A data-dependent scheme (``data_dependent``: fox, cope) instead computes its bias inside each
attention layer, from what that layer sees:

(d) ``key_state(layer, hidden)``: per-head scalars of each new token that later queries need
    (FoX's log forget gates), kept in the KV cache beside the token's key (``keeps_key_state``);
(e) ``layer_bias(layer, queries, keys, key_state, allowed, explain)``: the layer's additive
    score bias, from its queries, every key they may see and those keys' states.

A scheme may also replace softmax itself (``replaces_softmax``: stick-breaking), where the
order of the keys is what tells positions apart:

(f) ``attention_weights(scores, allowed)``: each query's weights over its keys, from the scores.

A scheme may also turn the keys themselves by what comes after them (``rewrites_keys``: PaTH):

(g) ``move_keys(layer, hidden, queries, keys, before, new_tokens)``: the new tokens' effect on
    the scores, and every key after the pass, which the KV cache keeps in place of the old.

The defaults contribute nothing, so ``none`` (NoPE) is the base class itself.

What the CPU decode kernel (``model.kernels.decode_step``) does for a scheme is declared here
too, never decided by its name: ``kernel_bias`` says where its bias comes from, and
``kernel_tensors`` and ``kernel_score_bias`` give the kernel what it reads. A scheme that
declares nothing the kernel knows is decoded by the torch blocks (``model.backend``).
Schemes are pure tensor code: they know positions and tensors, never tokens, caches or requests.
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

from model.errors import ConfigError
from model.positional.rotation import Rotation, apply_rotation

if TYPE_CHECKING:
    from model.cache import KVCache
    from model.config import ModelConfig


# How a scheme tells positions apart, by the hook it fills: "added" (a), "rotation" (b), "bias"
# (c), "data-dependent" (d, e), "weights" (f), or "none" (no hook: the base class itself).
SchemeKind = Literal["none", "added", "rotation", "bias", "data-dependent", "weights"]


class PositionOutOfRange(ValueError):
    """A position at or past a table-based scheme's ``max_positions`` was requested."""


class KernelBias(IntEnum):
    """Where a scheme's score bias comes from, as the CPU decode kernel computes it (its values
    are the kernel's ``Scheme`` enum)."""

    PASS = 0  # the pass's: attention_bias (c), computed once per pass, or none
    FORGETTING = 1  # FoX's: the sum of the cache's log forget gates after each key
    CONTEXTUAL = 2  # CoPE's: the table read at each key's counted position


class KernelTensors(NamedTuple):
    """What the decode kernel reads for a scheme's own bias (each empty where unused)."""

    gate_weight: Tensor  # FoX: [layers, H, d_model]
    gate_bias: Tensor  # FoX: [layers, H]
    states: Tensor  # FoX: the cache's log gates [layers, rows, H, length]
    table: Tensor  # CoPE: [layers, n, hd]


_EMPTY = torch.empty(0)
_NO_KERNEL_TENSORS = KernelTensors(_EMPTY, _EMPTY, _EMPTY, _EMPTY)


class MovedKeys(NamedTuple):
    """What a scheme that turns keys (g) does in one layer's pass."""

    bias: Tensor  # [B, H, Tq, Tk] added to the scaled scores q·k/√hd of the keys as given
    keys: Tensor  # [B, H, Tk, hd] every key after the pass, which the cache keeps


class LayerBias(NamedTuple):
    """What a data-dependent scheme adds to one layer's scores, and how it got there (the
    trace shows both; each field is None where the scheme has no such thing)."""

    bias: Tensor  # [B, H, Tq, Tk] added to the scaled scores q·k/√hd
    gates: Tensor | None = None  # [B, H, Tk] a gate in (0, 1) per key (FoX's forget gates)
    positions: Tensor | None = None  # [B, H, Tq, Tk] a position per query and key (CoPE's)


@dataclasses.dataclass(frozen=True)
class NoParams:
    """Schemes without parameters accept no keys beyond "scheme"."""


class PositionalScheme(nn.Module):
    """Base class and registry interface. Subclasses set ``name`` and, if any, ``Params``, and
    ``is_table`` when their positions are the rows of a table of ``config.max_positions``."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    # Which hook carries the position (SchemeKind), and what the scheme predicts one should see
    # when the prompt is moved or its signal removed: one line, in /v1/models (the playground's
    # note beside the experiments), so that a new scheme brings its own.
    kind: ClassVar[SchemeKind] = "none"
    claim: ClassVar[str] = ""
    # True: one stored row per position, so positions stop at config.max_positions;
    # False: a formula, computed for any position.
    is_table: ClassVar[bool] = False
    # True: the scheme's bias comes from each layer's own queries, keys or input (layer_bias),
    # so the model always builds the explicit causal mask and calls the per-layer hooks.
    data_dependent: ClassVar[bool] = False
    # True: key_state gives each token per-head scalars that the KV cache keeps beside its key.
    keeps_key_state: ClassVar[bool] = False
    # True: attention_weights replaces softmax (f), so the model builds the explicit mask and
    # attention weighs the values itself rather than through SDPA.
    replaces_softmax: ClassVar[bool] = False
    # True: move_keys turns every key by the tokens after it (g), and the cache keeps the
    # turned keys; such a scheme is data_dependent and never prefix_stable.
    rewrites_keys: ClassVar[bool] = False
    # How many times a head's width its turned keys are (and so the cached ones): 2 for PoPE,
    # whose every component becomes a (cos, sin) pair.
    key_width_factor: ClassVar[int] = 1
    # What the CPU decode kernel computes of this scheme's bias; None: the kernel cannot run it
    # (the torch blocks decode it). PASS for every scheme whose signal is hooks (a)-(c); a
    # data-dependent scheme's bias is its own, so unless its class names it, None
    # (__init_subclass__): a new one is never run by a kernel that would leave its bias out.
    kernel_bias: ClassVar[KernelBias | None] = KernelBias.PASS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if (cls.data_dependent or cls.replaces_softmax) and "kernel_bias" not in cls.__dict__:
            cls.kernel_bias = None  # the kernel's softmax and biases are not this scheme's

    def __init__(self, config: ModelConfig, params: Any) -> None:
        super().__init__()
        self.config = config
        self.params = params
        # None = any position is fine; an int = positions must stay below it (a table's rows,
        # or a formula's own limit, such as binary's 2**bits).
        self.max_positions: int | None = config.max_positions if self.is_table else None
        if self.data_dependent and config.key_value_heads != config.n_heads:
            # Their bias is per query head, from keys (and key states) of the same head.
            raise ConfigError(
                f"positional scheme {self.name!r} needs one key/value head per query head "
                f"(n_kv_heads {config.n_kv_heads} given for n_heads {config.n_heads})"
            )

    @property
    def prefix_stable(self) -> bool:
        """Whether each token's key, value and key state depend on that token and the ones
        before it alone, whatever pass computed them: then a prompt's prefix kept from an
        earlier request (``model.prefix_cache``) is what a new pass would compute. True of
        every hook above: (a) and (b) are per position, (d) per token, and the biases (c) and
        (e) are computed at query time from positions, queries and the keys kept (FoX sums the
        kept gates of the keys a query sees, CoPE counts from its queries and the kept keys);
        table schemes (learned, mds, lowrank) look up fixed rows. A scheme whose tables
        depend on the pass (rope's dynamic scaling) says False."""
        return True

    def acts_at(self, layer: int) -> bool:
        """Whether layer ``layer`` gets this scheme's rotation, bias and per-layer hooks; the
        layers a schedule leaves out (irope's NoPE layers) attend as ``none``'s do."""
        return True

    def query_scale(self, positions: Tensor) -> Tensor | None:
        """A factor on the queries at ``positions`` [B, T] → [B, 1, T, 1] in the layers this
        scheme leaves out (Llama 4's attention temperature), or None."""
        return None

    def embedding(self, positions: Tensor) -> Tensor | None:
        """Additive vectors for ``positions`` [B, T] (long) → [B, T, d_model], or None."""
        return None

    def rotation(self, positions: Tensor) -> Rotation | None:
        """(cos, sin) rotating q and k at ``positions`` [B, T] → each [B, 1, T, rot], or None."""
        return None

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Additive score bias for queries [B, Tq] against keys [Tk] → [B, H, Tq, Tk], or None."""
        return None

    def key_state(self, layer: int, hidden: Tensor) -> Tensor | None:
        """Per-head scalars [B, H, T] of each token of ``hidden`` [B, T, d_model] (layer
        ``layer``'s normalised input) that later queries need, or None."""
        return None

    def layer_bias(
        self,
        layer: int,
        queries: Tensor,
        keys: Tensor,
        key_state: Tensor | None,
        allowed: Tensor,
        explain: bool = True,
    ) -> LayerBias | None:
        """Layer ``layer``'s score bias, or None. ``queries`` [B, H, Tq, hd] and ``keys``
        [B, H, Tk, hd] (every key the queries may see, the cached ones included); ``key_state``
        [B, H, Tk] what key_state gave for those keys; ``allowed`` [B|1, 1, Tq, Tk] bool, True
        where query i may see key j (causality; padding and unwritten slots are False).
        ``explain``: also fill LayerBias's other fields, which only the trace reads (the model
        passes False otherwise, and a scheme may then take a faster path to the same bias)."""
        return None

    def move_keys(
        self,
        layer: int,
        hidden: Tensor,
        queries: Tensor,
        keys: Tensor,
        before: Tensor,
        new_tokens: Tensor | None,
    ) -> MovedKeys:
        """(g) Layer ``layer``'s pass of the new tokens of ``hidden`` [B, Tq, d_model] (its
        normalised input), whose ``queries`` are [B, H, Tq, hd], over ``keys`` [B, H, Tk, hd]
        (as the cache holds them; the new tokens' own as computed); ``before`` [B|1, 1, Tq, Tk]
        bool: key j comes before new token s; ``new_tokens`` [B, Tq] bool, False on a ragged
        pass's padding (None: no padding). Only where ``rewrites_keys``."""
        raise NotImplementedError(f"scheme {self.name!r} does not turn its keys")

    def attention_weights(self, scores: Tensor, allowed: Tensor) -> Tensor:
        """(f) Each query's weights over its keys [B, H, Tq, Tk] from ``scores`` (q·k/√d plus
        any bias, same shape) where ``allowed`` [B|1, 1, Tq, Tk] (0 elsewhere); softmax here,
        which SDPA computes for every scheme that does not replace it."""
        return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)

    def kernel_tensors(self, cache: KVCache) -> KernelTensors:
        """What the decode kernel reads for this scheme's own bias (``kernel_bias``): nothing
        here; FoX's gates and the cache's log gates, CoPE's table."""
        return _NO_KERNEL_TENSORS

    def kernel_score_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """``attention_bias`` for a decode kernel pass (one query per row): the same bias, by
        whatever way is fastest there (FIRE's MLP in the kernel)."""
        return self.attention_bias(q_positions, k_positions)

    def turn(self, queries_keys: Tensor, rotation: Rotation, n_heads: int, layer: int) -> Tensor:
        """(b) applied in layer ``layer``: queries then keys [B, H + Hkv, T, hd] (``n_heads`` of
        them queries) turned by ``rotation`` → [B, H + Hkv, T, hd · key_width_factor]."""
        return apply_rotation(queries_keys, *rotation)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Apply this scheme's rotation to ``x`` [B, H, T, head_dim] (identity if it has none)."""
        rotation = self.rotation(positions)
        if rotation is None:
            return x
        return apply_rotation(x, *rotation)

    def reserve(self, n_positions: int, device: torch.device) -> tuple[Tensor, ...]:
        """Build now every table a pass over positions below ``n_positions`` reads, and return
        those tables: a captured decode step (``model.captured``) cannot build one, and keeps
        what it read alive. None here; rope grows its cos/sin table."""
        return ()

    def check_positions(self, positions: Tensor) -> None:
        """Raise PositionOutOfRange if any position is at or past ``max_positions``."""
        if self.max_positions is None or positions.numel() == 0:
            return
        if capturing(positions):  # a captured step's caller checked them on the host
            return
        largest = int(positions.max())
        if largest >= self.max_positions:
            raise PositionOutOfRange(
                f"position {largest} is out of range for the '{self.name}' scheme, which has a "
                f"table of max_positions={self.max_positions} (0..{self.max_positions - 1})"
            )

    def extra_repr(self) -> str:
        return f"scheme={self.name!r}, params={self.params}"


def capturing(tensor: Tensor) -> bool:
    """Whether ``tensor``'s device is recording a CUDA graph now: reading a value back to the
    host (``int(positions.max())``) would break the capture."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def positions_table(n_positions: int, device: torch.device | None = None) -> Tensor:
    """Positions 0..n-1 as a [1, n] long tensor (the batch-shared layout schemes accept)."""
    return torch.arange(n_positions, device=device).unsqueeze(0)


def sum_back_to_each_key(values: Tensor, allowed: Tensor) -> Tensor:
    """For each query i and key j, the sum of ``values`` over the keys t ≥ j that i may see
    → [B, H, Tq, Tk] (FoX's forgetting and CoPE's counting are both such sums).

    ``values`` [B, H, Tq|1, Tk] per key (per query, or shared by all), ``allowed`` [B|1, 1, Tq, Tk]
    bool. Summed from the query's last visible key back, so the running sum is the same however
    many unseen slots follow (a cached step's keys past the query add exact zeros).
    """
    return torch.where(allowed, values, 0.0).flip(-1).cumsum(-1).flip(-1)
