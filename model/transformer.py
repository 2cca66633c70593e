"""The decoder-only transformer: token embedding → positional scheme → pre-norm blocks → logits.

The whole model reads in one sitting. Where a positional scheme acts is decided by the scheme
(``model.positional``), computed once per forward pass and handed to every layer:
an additive vector on the embeddings, a rotation of queries and keys, or a bias on scores; a
data-dependent scheme (fox, cope) adds its bias inside each layer, from that layer's own inputs.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.backend import Backend, backend_of
from model.cache import CacheWrite, KVCache
from model.config import ModelConfig
from model.kernels import decode_step
from model.kernels import linear as linear_kernel
from model.positional import PositionalScheme, build_scheme
from model.positional.base import LayerBias
from model.positional.rotation import Rotation


@dataclass(frozen=True)
class AttentionMask:
    """What SDPA needs: an additive/boolean mask [B, 1|H, Tq, Tk], or the built-in causal mask."""

    mask: Tensor | None
    is_causal: bool

    def allowed(self) -> Tensor:
        """[B|1, 1, Tq, Tk] bool: where a query may look (only for an explicit mask)."""
        assert self.mask is not None, "the built-in causal mask has no tensor"
        return self.mask if self.mask.dtype == torch.bool else self.mask > float("-inf")

    def plus(self, bias: Tensor) -> AttentionMask:
        """This mask with ``bias`` [B, H, Tq, Tk] added where a query may look."""
        assert self.mask is not None, "the built-in causal mask has no tensor"
        if self.mask.dtype == torch.bool:
            return AttentionMask(bias.where(self.mask, float("-inf")), is_causal=False)
        return AttentionMask(self.mask + bias.to(self.mask.dtype), is_causal=False)


class AttentionRecorder:
    """Pass one to :meth:`Transformer.forward` to keep every layer's attention weights.

    Tracing only (``/v1/trace``): each layer still computes its output with SDPA, and also the
    softmax weights from the same queries, keys and mask, appended to ``weights`` — one
    [B, H, Tq, Tk] float32 tensor per layer, each row summing to 1 over the keys it may see.
    Without a recorder (every decode step) nothing extra is computed. A data-dependent scheme's
    per-layer bias (``LayerBias``) is kept in ``layer_biases``, one per layer; ``weights=False``
    keeps only those.
    """

    def __init__(
        self, weights: bool = True, scores_of: int | None = None, outputs: bool = False
    ) -> None:
        self.keep_weights = weights
        self.weights: list[Tensor] = []
        self.layer_biases: list[LayerBias] = []
        # The residual stream entering layer 0 [B, T, d_model], then each block's output, which
        # the logit lens reads (Transformer.unembed); the last is what the logits come from.
        self.embedded: Tensor | None = None
        self.residuals: list[Tensor] = []
        # ``scores_of`` layer: what its scores are made of (server/engine/explain.py splits them)
        self.scores_of = scores_of
        self.scores: LayerScores | None = None
        # ``outputs``: each layer's heads' outputs [B, H, T, hd] before the output projection,
        # and each MLP's output [B, T, d_model]: the parts a logit is the sum of
        self.keep_outputs = outputs
        self.head_outputs: list[Tensor] = []
        self.mlp_outputs: list[Tensor] = []

    def record(
        self,
        layer: int,
        queries: Tensor,
        keys: Tensor,
        mask: AttentionMask,
        layer_bias: LayerBias | None = None,
        unrotated: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> None:
        """queries [B, H, Tq, hd], keys [B, Hkv, Tk, hd]: softmax(q·kᵀ/√hd + mask), as SDPA
        (each key head shared by H / Hkv consecutive query heads), or the ``weights`` a scheme
        that replaces softmax gave [B, H, Tq, Tk]; ``unrotated`` [B, H + Hkv, T, hd]: the
        queries and keys before any rotation."""
        if layer_bias is not None:
            self.layer_biases.append(layer_bias)
        if layer == self.scores_of:
            self.scores = LayerScores(queries, keys, unrotated, mask)
        if not self.keep_weights:
            return
        if weights is not None:
            self.weights.append(weights.float())
            return
        keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
        scores = queries.float() @ keys.float().transpose(-2, -1) / math.sqrt(queries.shape[-1])
        if mask.is_causal:  # SDPA's built-in mask: query i sees keys 0..i
            length, key_length = scores.shape[-2:]
            causal = torch.ones(length, key_length, dtype=torch.bool, device=scores.device)
            scores = scores.masked_fill(~causal.tril(), float("-inf"))
        elif mask.mask is not None and mask.mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask.mask, float("-inf"))
        elif mask.mask is not None:
            scores = scores + mask.mask.float()
        self.weights.append(scores.softmax(dim=-1))


class LayerScores(NamedTuple):
    """What one layer's attention scores were computed from (a traced pass, one layer)."""

    queries: Tensor  # [B, H, T, hd], rotated where the scheme rotates
    keys: Tensor  # [B, Hkv, T, hd], likewise
    unrotated: Tensor | None  # [B, H + Hkv, T, hd]: queries then keys, before the rotation
    mask: AttentionMask  # causality, and the scheme's bias (its own and the layer's)


@dataclass(frozen=True)
class ResidualPatch:
    """Activation patching: before block ``s`` (``s`` = n_layers: after the last), row b's
    residual stream at position ``positions[b]`` becomes ``values[b]`` where ``streams[b]`` is
    ``s``. ``streams``, ``positions`` [B]; ``values`` [B, d_model]."""

    streams: Tensor
    positions: Tensor
    values: Tensor

    def apply(self, x: Tensor, stream: int) -> Tensor:
        """``x`` [B, T, d_model] with this stream's patches written in."""
        rows = (self.streams == stream).nonzero()[:, 0]
        if rows.numel() == 0:
            return x
        return x.index_put((rows, self.positions[rows]), self.values[rows].to(x.dtype))


@dataclass(frozen=True)
class Intervention:
    """Pass one to an uncached :meth:`Transformer.forward` to change it, testing what a scheme
    claims (tracing only, ``/v1/trace``).

    ``position_offset`` k: every position is shifted by k, as if the prompt started at k (a
    relative scheme's logits do not change; an absolute scheme's do). ``ablate``: these
    (layer, head) pairs have their attention output zeroed before the output projection.
    ``drop_positional``: in these layers the scheme's signal is removed (no rotation, no score
    bias); an added vector enters the residual stream once, before layer 0, so it is left out
    when layer 0 is dropped. Dropping every layer runs the weights as the ``none`` scheme.
    ``patch``: residual streams replaced at chosen positions (ResidualPatch).
    """

    position_offset: int = 0
    ablate: frozenset[tuple[int, int]] = frozenset()
    drop_positional: frozenset[int] = frozenset()
    patch: ResidualPatch | None = None

    def head_gates(self, layer: int, n_heads: int, device: torch.device) -> Tensor | None:
        """[H, 1, 1]: 0 for this layer's ablated heads, 1 for the others; None if none is."""
        heads = [head for ablated_layer, head in self.ablate if ablated_layer == layer]
        if not heads:
            return None
        gates = torch.ones(n_heads, 1, 1, device=device)
        gates[heads] = 0.0
        return gates


@dataclass(frozen=True)
class LayerInputs:
    """What a block's attention reads besides its input: the pass's rotation and mask, the cache
    and its planned write (None: an uncached pass), the scheme's per-layer hooks (None: its
    signal dropped), and for a traced pass the recorder and the heads to silence."""

    rotation: Rotation | None  # (cos, sin) [B, 1, T, rot] each
    mask: AttentionMask
    cache: KVCache | None = None
    plan: CacheWrite | None = None
    scheme: PositionalScheme | None = None
    recorder: AttentionRecorder | None = None
    head_gates: Tensor | None = None  # [H, 1, 1]: 0 for an ablated head, 1 for the others
    query_scale: Tensor | None = None  # [B|1, 1, T, 1]: the scheme's, where it skips a layer
    # For a scheme that turns keys (PaTH): [B|1, 1, T, Tk] key j comes before new token s, and
    # [B, T] the new tokens that are not a ragged pass's padding (None: all are)
    before: Tensor | None = None
    new_tokens: Tensor | None = None


class Linear(nn.Linear):
    """nn.Linear whose decode-sized products at inference on a CPU run ``model.kernels.linear``:
    faster than MKL there, and the same bits for a row alone or in any batch. Its weight is
    stored column-major (below); parameters and checkpoints are nn.Linear's."""

    def forward(self, x: Tensor) -> Tensor:
        if linear_kernel.applies(x, self.weight):
            return linear_kernel.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _store_column_major(linear: nn.Linear) -> None:
    """Keep ``linear.weight`` [out, in] as a view of contiguous [in, out] memory, in place.

    ``F.linear`` computes x @ weight.T; with this layout weight.T is contiguous, which CPU GEMMs
    run 1.2-2x faster at decode sizes (a few rows of input). Values, shapes and the checkpoint
    format are unchanged: loading copies into this layout and saving writes contiguous tensors.
    The Parameter object stays the same, so a tied lm_head and embedding stay tied.
    """
    with torch.no_grad():
        linear.weight.data = linear.weight.data.t().contiguous().t()


def pin_members(root: nn.Module) -> None:
    """Give every parameter and child module of ``root`` and its descendants a plain instance
    attribute as well, so that reading ``self.qkv`` is one dict lookup.

    nn.Module keeps them only in ``_parameters``/``_modules``: each read first misses the
    instance dict, builds an AttributeError (its message formatted, then dropped) and only then
    reaches ``Module.__getattr__`` — thousands of instructions a read, and a decode step makes
    ~120 such reads (every ``self.weight``, ``self.bias``, ``self.qkv``...): 13-20% of a batch-1
    step's instructions (callgrind; docs/performance.md). Assigning a Parameter or a Module to
    the name (``load_state_dict(assign=True)`` included) drops the plain attribute, and loading
    changes tensors in place, so it stays the member it mirrors. Buffers are left out: assigning
    a tensor to a buffer's name would not drop it, and the few buffer reads cost little. Setting
    a member to None after pinning would leave it stale; nothing in ordinal does.
    """
    for module in root.modules():
        for table in (module._parameters, module._modules):
            module.__dict__.update(table)  # None too: a Linear without bias reads its None


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    eps = 1e-5 if config.norm_eps is None else config.norm_eps  # 1e-5: torch's default
    return nn.LayerNorm(config.d_model, eps=eps, bias=config.bias)


# cuDNN's fused attention, which torch tries first on a Hopper GPU, builds an execution plan for
# every new shape: 53-57 ms a call on an H200 (bench/results-cuda/sdpa.txt), and an uncaptured
# decode step's key length is new at almost every step (8 streams served at 37-57 ms a step,
# 91% of it in attention). Flash and memory-efficient attention need no plan; the math kernel
# takes what they cannot.
GPU_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def weigh(queries: Tensor, keys: Tensor, mask: AttentionMask, scheme: PositionalScheme) -> Tensor:
    """The weights of a scheme that replaces softmax (stick-breaking): q·kᵀ/√hd of ``queries``
    [B, H, Tq, hd] and ``keys`` [B, Hkv, Tk, hd], plus the mask's bias where it allows, through
    ``scheme.attention_weights`` → [B, H, Tq, Tk] float32."""
    keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
    scores = queries.float() @ keys.float().transpose(-2, -1) / math.sqrt(queries.shape[-1])
    allowed = mask.allowed()
    if mask.mask is not None and mask.mask.dtype != torch.bool:
        scores = scores + mask.mask.float().where(allowed, 0.0)
    return scheme.attention_weights(scores, allowed)


def attend(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: AttentionMask,
    dropout: float,
    grouped: bool,
) -> Tensor:
    """SDPA of ``queries`` [B, H, Tq, hd] over ``keys`` and ``values`` [B, Hkv, Tk, hd] →
    [B, H, Tq, hd], in the queries' dtype.

    Training in bfloat16 on a CPU, fused attention runs in float32: torch's fused CPU kernel
    is much slower backwards in bfloat16, and upcasting took a compiled bfloat16 alibi step from
    2.96 to 3.9–4.0 steps/s (docs/performance.md). A bias that needs its own gradient (t5,
    fire, fox, cope) takes SDPA's unfused path, which bfloat16 does speed up, so it stays.
    """
    attn_mask = mask.mask
    fused = attn_mask is None or not attn_mask.requires_grad  # a learned bias takes SDPA's math
    upcast = (
        fused
        and queries.requires_grad
        and queries.device.type == "cpu"
        and queries.dtype == torch.bfloat16
    )
    if upcast:
        queries, keys, values = queries.float(), keys.float(), values.float()
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()
    with (
        torch.autocast(queries.device.type, enabled=False) if upcast else nullcontext(),
        sdpa_kernel(GPU_ATTENTION) if queries.is_cuda else nullcontext(),
    ):
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=attn_mask,
            is_causal=mask.is_causal,
            dropout_p=dropout,
            enable_gqa=grouped,
        )
    return out.to(torch.bfloat16) if upcast else out


class Attention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (queries of every head,
    then keys, then values); with fewer key/value heads than query heads it is grouped-query
    attention. With ``config.qk_norm``, queries and keys are RMS-normalised per head (a
    learned gain each) before rotation."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.n_kv_heads = config.key_value_heads
        qkv_width = (config.n_heads + 2 * self.n_kv_heads) * config.head_dim
        self.qkv = Linear(config.d_model, qkv_width, bias=config.bias)
        self.proj = Linear(config.d_model, config.d_model, bias=config.bias)
        self.dropout = config.dropout
        # [2, 1, 1, 1, hd]: the query gain and the key gain, broadcast over [2, B, H, T, hd].
        self.qk_norm = (
            nn.Parameter(torch.ones(2, 1, 1, 1, config.head_dim)) if config.qk_norm else None
        )

    def forward(self, x: Tensor, inputs: LayerInputs, layer: int) -> Tensor:
        """``x`` [B, T, d_model] → [B, T, d_model], as layer ``layer`` of a pass (``inputs``):
        the scheme's per-layer hooks (fox, cope) add their bias to the mask; a recorder keeps
        what it sees; head gates scale each head's output (an Intervention's ablation)."""
        batch, length, width = x.shape
        heads, kv_heads = self.n_heads, self.n_kv_heads
        rotation, mask, cache, plan = inputs.rotation, inputs.mask, inputs.cache, inputs.plan
        scheme, recorder, head_gates = inputs.scheme, inputs.recorder, inputs.head_gates
        qkv = self.qkv(x).view(batch, length, heads + 2 * kv_heads, self.head_dim)
        qkv = qkv.transpose(1, 2)  # [B, H + 2·Hkv, T, hd]
        queries_keys, values = qkv.split([heads + kv_heads, kv_heads], dim=1)
        if self.qk_norm is not None:  # queries and keys normalised, each with its own gain
            queries, keys = F.rms_norm(queries_keys, (self.head_dim,)).split([heads, kv_heads], 1)
            queries_keys = torch.cat([queries * self.qk_norm[0], keys * self.qk_norm[1]], dim=1)
        unrotated = queries_keys  # apply_rotation makes a new tensor: a recorder may keep this
        if rotation is not None:  # queries and keys in one call: half the small ops
            assert scheme is not None  # a pass's rotation comes with its scheme
            queries_keys = scheme.turn(queries_keys, rotation, heads, layer)
        queries, keys = queries_keys.split([heads, kv_heads], dim=1)  # [B, H|Hkv, T, hd]
        if inputs.query_scale is not None:
            queries = queries * inputs.query_scale.to(queries.dtype)
        state = None if scheme is None else scheme.key_state(layer, x)  # [B, H, T] or None
        if cache is not None:
            assert plan is not None  # the model plans the write of every cached pass
            keys, values = cache.write(layer, plan, keys, values)  # [B, Hkv, key_length, hd]
            if state is not None:
                state = cache.write_key_state(layer, plan, state)  # [B, H, key_length]
        layer_bias = None
        if scheme is not None and scheme.data_dependent:  # fox, cope: one key head per query head
            explain = recorder is not None
            layer_bias = scheme.layer_bias(layer, queries, keys, state, mask.allowed(), explain)
        moved = None  # PaTH: the keys turned by this pass's tokens, kept once attention is done
        if scheme is not None and scheme.rewrites_keys:
            assert inputs.before is not None  # the pass computes it for such a scheme
            moved = scheme.move_keys(layer, x, queries, keys, inputs.before, inputs.new_tokens)
            layer_bias = (  # PaTH-FoX: the gates' bias and the transitions' on the same scores
                LayerBias(moved.bias)
                if layer_bias is None
                else layer_bias._replace(bias=layer_bias.bias + moved.bias)
            )
        if layer_bias is not None:
            mask = mask.plus(layer_bias.bias.to(queries.dtype))
        weights = None  # [B, H, T, Tk]: the scheme's own, where it replaces softmax
        if scheme is not None and scheme.replaces_softmax:
            weights = weigh(queries, keys, mask, scheme)
        if recorder is not None:
            recorder.record(layer, queries, keys, mask, layer_bias, unrotated, weights)
        if weights is None:
            dropout = self.dropout if self.training else 0.0
            out = attend(queries, keys, values, mask, dropout, kv_heads != heads)  # [B, H, T, hd]
        else:
            values = values.repeat_interleave(heads // kv_heads, dim=1)
            out = weights.to(values.dtype) @ values
        if moved is not None and cache is not None:
            assert plan is not None
            cache.rewrite_keys(layer, plan, moved.keys)
        if head_gates is not None:
            out = out * head_gates.to(out.dtype)
        if recorder is not None and recorder.keep_outputs:
            recorder.head_outputs.append(out)
        out = self.proj(out.transpose(1, 2).reshape(batch, length, width))
        return F.dropout(out, self.dropout) if self.training else out


class FeedForward(nn.Module):
    """GELU MLP (exact, or GPT-2's tanh approximation), ReLU² MLP, or SwiGLU (gate and value
    projections fused into one matrix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gated = config.mlp == "swiglu"
        self.squared_relu = config.mlp == "relu2"
        self.gelu_approximation = "tanh" if config.mlp == "gelu_tanh" else "none"
        expanded = 2 * config.d_ff if self.gated else config.d_ff
        self.up = Linear(config.d_model, expanded, bias=config.bias)
        self.down = Linear(config.d_ff, config.d_model, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [B, T, d_model] → [B, T, d_model]."""
        hidden = self.up(x)
        if self.gated:
            gate, value = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * value
        elif self.squared_relu:
            hidden = F.relu(hidden).square()
        else:
            hidden = F.gelu(hidden, approximate=self.gelu_approximation)
        out = self.down(hidden)
        return F.dropout(out, self.dropout) if self.training else out


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config)
        self.mlp_norm = make_norm(config)
        self.mlp = FeedForward(config)

    def forward(self, x: Tensor, inputs: LayerInputs, layer: int) -> Tensor:
        """``x`` [B, T, d_model] → [B, T, d_model], as layer ``layer`` of the pass ``inputs``."""
        x = x + self.attention(self.attention_norm(x), inputs, layer)
        fed = self.mlp(self.mlp_norm(x))
        if inputs.recorder is not None and inputs.recorder.keep_outputs:
            inputs.recorder.mlp_outputs.append(fed)
        return x + fed


class Transformer(nn.Module):
    """A decoder-only language model whose positional scheme is chosen by ``config.positional``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.positional = build_scheme(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        # The layers the scheme's schedule leaves without its signal (irope's NoPE layers),
        # fixed by the config: a pass reads this rather than asking the scheme per layer.
        layers = range(config.n_layers)
        self.skipped_layers = frozenset(i for i in layers if not self.positional.acts_at(i))
        self.final_norm = make_norm(config)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        self._initialise()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _store_column_major(module)
        pin_members(self)

    def _apply(self, fn, recurse=True):  # nn.Module's signature
        # .to() / .float() / .cuda(): a parameter that cannot be changed in place is replaced in
        # its module's table, behind the plain attribute pin_members left.
        applied = super()._apply(fn, recurse)
        pin_members(self)
        return applied

    def _initialise(self) -> None:
        # GPT-2 initialisation; residual projections shrink with depth so the residual stream's
        # variance does not grow with the number of layers. Schemes initialise their own tables.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, parameter in self.named_parameters():
            if name.startswith("positional."):
                continue
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif "norm" in name:
                nn.init.ones_(parameter)
            elif name.endswith(("attention.proj.weight", "mlp.down.weight")):
                nn.init.normal_(parameter, std=residual_std)
            else:
                nn.init.normal_(parameter, std=0.02)

    def num_parameters(self) -> int:
        """Trainable and stored parameters, counting tied weights once."""
        return sum(parameter.numel() for parameter in self.parameters())

    def forward(
        self,
        tokens: Tensor,
        cache: KVCache | None = None,
        *,
        rows: slice | None = None,
        new_counts: Tensor | None = None,
        last_only: bool = False,
        plan: CacheWrite | None = None,
    ) -> Tensor:
        """Logits for ``tokens`` [B, T] → [B, T, vocab] (or [B, vocab] with ``last_only``).

        Without a cache, every row starts at position 0 (training and scoring). With a cache,
        row b continues the sequence stored in cache row ``rows.start + b``: its tokens take the
        next positions, their keys and values are stored, and they attend to everything cached.
        ``new_counts`` [B] marks a ragged batch: row b has only its first new_counts[b] tokens,
        the rest is right-padding that is neither stored nor attended to. ``plan``: the write
        planned by the caller (a captured step's), who then advances the lengths itself. On the
        CPU kernel backend a decode step is one C++ call; :meth:`traced_forward` traces."""
        if plan is not None and cache is None:
            raise ValueError("a planned write needs the cache it was planned for")
        given = plan
        positions, key_positions, plan = self._positions(tokens, cache, rows, new_counts, plan)
        if cache is not None and decode_step.applies(self, tokens):
            assert plan is not None  # planned with the cache
            logits = self._kernel_pass(tokens, cache, plan, key_positions)  # [B, vocab]
            logits = logits if last_only else logits.unsqueeze(1)
        else:
            x = self.embed(tokens, positions)  # [B, T, d_model]
            inputs = self._layer_inputs(positions, key_positions, cache, plan, x.dtype)
            for layer, block in enumerate(self.blocks):
                x = block(x, inputs[layer], layer)  # [B, T, d_model]
            logits = self.lm_head(self.final_norm(self._last(x, new_counts, last_only)))
        if cache is not None and given is None:
            assert plan is not None
            cache.commit(plan)
        return logits

    def traced_forward(
        self,
        tokens: Tensor,
        recorder: AttentionRecorder | None = None,
        intervention: Intervention | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """The trace's uncached pass (``server/engine/trace.py``): ``forward``'s logits for
        ``tokens`` [B, T] → [B, T, vocab] (or [B, vocab] with ``last_only``), each layer's
        attention and residual stream kept by ``recorder``, the pass changed by
        ``intervention`` (see Intervention)."""
        change = intervention or Intervention()
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, T]
        positions = positions + change.position_offset
        x = self.embed(tokens, positions, with_vector=0 not in change.drop_positional)
        layer_inputs = self._layer_inputs(
            positions, positions[0], None, None, x.dtype, change.drop_positional
        )
        if recorder is not None:
            recorder.embedded = x
        for layer, block in enumerate(self.blocks):
            if change.patch is not None:
                x = change.patch.apply(x, layer)
            gates = change.head_gates(layer, self.config.n_heads, tokens.device)
            inputs = replace(layer_inputs[layer], recorder=recorder, head_gates=gates)
            x = block(x, inputs, layer)
            if recorder is not None:
                recorder.residuals.append(x)
        if change.patch is not None:
            x = change.patch.apply(x, len(self.blocks))
        return self.lm_head(self.final_norm(self._last(x, None, last_only)))

    def embed(self, tokens: Tensor, positions: Tensor, with_vector: bool = True) -> Tensor:
        """The residual stream's start: ``tokens`` [B, T] embedded, plus the scheme's position
        vectors for ``positions`` [B|1, T] (absolute schemes; ``with_vector`` False: left out)
        → [B, T, d_model]."""
        x = self.token_embedding(tokens)
        vectors = self.positional.embedding(positions) if with_vector else None
        if vectors is not None:
            x = x + vectors.to(x.dtype)
        return F.dropout(x, self.config.dropout) if self.training else x

    def _positions(
        self,
        tokens: Tensor,
        cache: KVCache | None,
        rows: slice | None,
        new_counts: Tensor | None,
        plan: CacheWrite | None,
    ) -> tuple[Tensor, Tensor, CacheWrite | None]:
        """The pass's query positions [B|1, T], key positions [Tk], and its cache write: the
        one given, else planned for ``rows`` (None without a cache)."""
        batch, length = tokens.shape
        device = tokens.device
        if cache is None:
            positions = torch.arange(length, device=device).unsqueeze(0)  # [1, T]
            return positions, positions[0], None
        if plan is None:
            plan = cache.positions(rows or slice(0, batch), length, new_counts)
        if plan.positions.shape[0] != batch:
            raise ValueError(
                f"rows={rows} selects {plan.positions.shape[0]} cache rows for a batch of "
                f"{batch} rows"
            )
        key_positions = torch.arange(plan.key_length, device=device)
        return plan.positions.to(device), key_positions, plan

    @staticmethod
    def _last(x: Tensor, new_counts: Tensor | None, last_only: bool) -> Tensor:
        """``x`` [B, T, d] as it is, or with ``last_only`` each row's last real token → [B, d]."""
        if not last_only:
            return x
        if new_counts is None:
            return x[:, -1]
        rows = torch.arange(x.shape[0], device=x.device)
        return x[rows, (new_counts - 1).to(x.device)]

    def decode_entries(
        self, tokens: Tensor, cache: KVCache, plan: CacheWrite, logit_rows: Tensor | None = None
    ) -> Tensor:
        """The decode kernel's pass over ``plan`` (``KVCache.entries``: a decode step's rows and
        prompt chunks, several pass rows filling one cache row), committed: ``tokens`` [N, 1] →
        logits [N, vocab], or only those of ``logit_rows`` [k] (ascending) → [k, vocab]. Only
        where ``decode_step.applies`` to this model. It runs in calls of up to
        ``decode_step.MAX_ROWS`` pass rows, in order (a prompt's later tokens attend what the
        earlier ones stored); a pass row's numbers are the same in any call."""
        assert plan.slot_rows is not None, "a plan of KVCache.entries"
        key_positions = torch.arange(plan.key_length, device=tokens.device)
        logits = []
        for begin in range(0, tokens.shape[0], decode_step.MAX_ROWS):
            part = slice(begin, begin + decode_step.MAX_ROWS)
            piece = replace(plan, positions=plan.positions[part], slot_rows=plan.slot_rows[part])
            wanted = None
            if logit_rows is not None:  # this call's rows among them, counted from its first
                inside = (logit_rows >= begin) & (logit_rows < begin + decode_step.MAX_ROWS)
                wanted = logit_rows[inside] - begin
            logits.append(self._kernel_pass(tokens[part], cache, piece, key_positions, wanted))
        cache.commit(plan)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _kernel_pass(
        self,
        tokens: Tensor,
        cache: KVCache,
        plan: CacheWrite,
        key_positions: Tensor,
        logit_rows: Tensor | None = None,
    ) -> Tensor:
        """One decode kernel call: ``tokens`` [B, 1] at ``plan.positions`` [B, 1] (on the host,
        where the kernel runs) → logits [B, vocab] (or [k, vocab]: those of ``logit_rows``
        [k]), the scheme's position vectors, rotation and bias computed here from them."""
        positions = plan.positions
        return decode_step.run_step(
            self,
            tokens,
            self.positional.embedding(positions),
            cache,
            plan,
            self.positional.rotation(positions),
            self.positional.kernel_score_bias(positions, key_positions),
            logit_rows,
        )

    @property
    def decode_backend(self) -> Backend:
        """Which code runs this model's decode steps here (``model.backend``: chosen once per
        device, dtype and kernel variant)."""
        return backend_of(self)

    def unembed(self, hidden: Tensor) -> Tensor:
        """The logit lens: residual streams [..., d_model] → logits [..., vocab], read through
        the final norm and the unembedding exactly as the last block's output is."""
        return self.lm_head(self.final_norm(hidden))

    def _layer_inputs(
        self,
        positions: Tensor,
        key_positions: Tensor,
        cache: KVCache | None,
        plan: CacheWrite | None,
        dtype: torch.dtype,
        dropped: frozenset[int] = frozenset(),
    ) -> list[LayerInputs]:
        """What each layer's attention reads besides its input: the scheme's rotation, bias and
        hooks, computed once for the pass; in a layer the scheme's schedule leaves out
        (``acts_at``) none of them but its query scale, and in a ``dropped`` layer (an
        Intervention) nothing at all, as ``none``'s."""
        scheme = self.positional
        mask = self._attention_mask(positions, key_positions, plan, dtype)
        kept = LayerInputs(scheme.rotation(positions), mask, cache, plan, scheme)
        if scheme.rewrites_keys:
            before, new_tokens = self._transition_masks(positions, key_positions, plan)
            kept = replace(kept, before=before, new_tokens=new_tokens)
        if not dropped and not self.skipped_layers:
            return [kept] * self.config.n_layers
        causal = self._attention_mask(positions, key_positions, plan, dtype, with_scheme=False)
        plain = LayerInputs(None, causal, cache, plan)
        skipped = replace(plain, query_scale=scheme.query_scale(positions))
        return [
            plain if layer in dropped else skipped if layer in self.skipped_layers else kept
            for layer in range(self.config.n_layers)
        ]

    @staticmethod
    def _transition_masks(
        positions: Tensor, key_positions: Tensor, plan: CacheWrite | None
    ) -> tuple[Tensor, Tensor | None]:
        """LayerInputs' ``before`` and ``new_tokens`` for a scheme that turns keys."""
        before = (key_positions < positions.unsqueeze(-1)).unsqueeze(1)  # [B|1, 1, T, Tk]
        new_tokens = None
        if plan is not None and plan.same_start is None:  # padding past each row's count
            counts = plan.end - plan.positions[:, 0]  # [B]
            offsets = torch.arange(positions.shape[-1])
            new_tokens = (offsets < counts.unsqueeze(1)).to(positions.device)  # [B, T]
        return before, new_tokens

    def _attention_mask(
        self,
        positions: Tensor,
        key_positions: Tensor,
        plan: CacheWrite | None,
        dtype: torch.dtype,
        with_scheme: bool = True,
    ) -> AttentionMask:
        """Causality (a query sees keys at its own position or before) plus the scheme's bias
        (``with_scheme`` False: causality alone)."""
        scheme = self.positional
        bias = scheme.attention_bias(positions, key_positions) if with_scheme else None
        explicit = with_scheme and (scheme.data_dependent or scheme.replaces_softmax)
        if bias is None and not explicit:
            if plan is None or plan.same_start == 0:  # every row starts at position 0
                return AttentionMask(None, is_causal=True)
            if plan.same_start is not None and positions.shape[1] == 1:
                return AttentionMask(None, is_causal=False)  # one new token sees every slot
        allowed = key_positions <= positions.unsqueeze(-1)  # [B, Tq, Tk]
        allowed = allowed.unsqueeze(1)
        if bias is None:
            return AttentionMask(allowed, is_causal=False)
        return AttentionMask(bias.to(dtype).masked_fill(~allowed, float("-inf")), is_causal=False)
