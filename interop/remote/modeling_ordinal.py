"""ordinal's decoder for Hugging Face Transformers: a self-contained port (torch and transformers
only), loaded with ``trust_remote_code=True``.

The same model as ordinal's ``model/transformer.py`` with the same parameter names, so the
folder's model.safetensors holds ordinal's own tensors: token embedding → positional scheme →
pre-norm blocks (fused QKV attention, MLP) → final norm → logits. Every one of ordinal's ten
positional schemes is here, each as the small class ordinal has in ``model/positional/``:
an added vector (none, integer, binary, sinusoidal, learned, mds, lowrank), a rotation of
queries and keys (rope, with its context extensions), or a bias on the scores (alibi, t5).

Positions follow the attention mask (position = how many real tokens came before), so
left-padded batches in ``generate()`` get the positions each row would have alone; keys and
values are kept in a transformers ``DynamicCache``. This file was copied from ordinal
(interop/remote/) by ``ordinal export``.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_ordinal import OrdinalConfig

Rotation = tuple[Tensor, Tensor]  # (cos, sin), each [B, 1, T, rotary_dim]


# ----------------------------------------------------------------------------------------------
# Positional schemes: embedding(positions [B, T]) → [B, T, d] | None; rotation(positions) →
# Rotation | None; bias(queries [B, Tq], keys [B, Tk]) → [B, H, Tq, Tk] | None.


class Scheme(nn.Module):
    """No positional signal (NoPE); the base every scheme below changes one hook of."""

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.params = params

    def embedding(self, positions: Tensor) -> Tensor | None:
        return None

    def rotation(self, positions: Tensor) -> Rotation | None:
        return None

    def bias(self, queries: Tensor, keys: Tensor) -> Tensor | None:
        return None


def position_angles(positions: Tensor, dim: int, base: float) -> Tensor:
    """p · base^(-2i/dim) per pair i → [..., dim/2], float64 (as ordinal: exact cos/sin)."""
    pair = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64)
    return positions.to(torch.float64).unsqueeze(-1) * base ** (-pair / dim)


class Integer(Scheme):
    def embedding(self, positions: Tensor) -> Tensor:
        value = positions.to(torch.float32) * self.params.get("scale", 1.0)
        return value.unsqueeze(-1).expand(*positions.shape, self.config.d_model)


class Binary(Scheme):
    def embedding(self, positions: Tensor) -> Tensor:
        bits = self.params.get("bits", 16)
        powers = 2 ** torch.arange(bits, device=positions.device)
        vector = ((positions.unsqueeze(-1) // powers) % 2).to(torch.float32)
        return F.pad(vector, (0, self.config.d_model - bits)) * self.params.get("scale", 1.0)


class Sinusoidal(Scheme):
    def embedding(self, positions: Tensor) -> Tensor:
        angles = position_angles(positions, self.config.d_model, self.params.get("base", 10000.0))
        encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
        return encoding.to(torch.float32) * self.params.get("scale", 1.0)


class Learned(Scheme):
    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        self.table = nn.Parameter(torch.zeros(config.max_positions, config.d_model))

    def embedding(self, positions: Tensor) -> Tensor:
        return self.table[positions]


class Mds(Scheme):
    coordinates: Tensor  # a buffer (register_buffer below), declared for the type checker

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        rank = params.get("rank", 16)
        self.register_buffer("coordinates", torch.zeros(config.max_positions, rank))

    def embedding(self, positions: Tensor) -> Tensor:
        coordinates = self.coordinates[positions]
        padded = F.pad(coordinates, (0, self.config.d_model - coordinates.shape[-1]))
        return padded * self.params.get("scale", 1.0)


class LowRank(Scheme):
    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        rank = params.get("rank", 8)
        self.position_factor = nn.Parameter(torch.zeros(config.max_positions, rank))
        self.model_factor = nn.Parameter(torch.zeros(config.d_model, rank))

    def embedding(self, positions: Tensor) -> Tensor:
        return self.position_factor[positions] @ self.model_factor.T


class Rope(Scheme):
    """NeoX half-split rotation of the first rotary_dim dims; ``scaling`` linear, ntk, dynamic
    or yarn as ordinal's model/positional/rope.py (Hugging Face's definitions)."""

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        head_dim = config.d_model // config.n_heads
        self.rotary_dim = int(head_dim * params.get("rotary_fraction", 1.0)) // 2 * 2
        self.scaling = params.get("scaling")
        self.factor = params.get("scaling_factor", 1.0)
        self.original = params.get("original_context") or config.context_length

    def ntk_base(self, factor: float) -> float:
        base, dim = self.params.get("base", 10000.0), self.rotary_dim
        return base * factor ** (dim / (dim - 2)) if dim > 2 else base

    def frequencies(self, needed: int, device: torch.device) -> tuple[Tensor, float]:
        """Each pair's angle per position → [rot/2] float64, and the cos/sin scale."""
        dim, base = self.rotary_dim, self.params.get("base", 10000.0)
        pair = torch.arange(dim // 2, device=device, dtype=torch.float64)
        if self.scaling == "ntk":
            base = self.ntk_base(self.factor)
        elif self.scaling == "dynamic":  # NTK for the current length once past the trained one
            length = max(needed, self.original)
            base = self.ntk_base(self.factor * length / self.original - (self.factor - 1))
        frequencies = base ** (-2 * pair / dim)
        if self.scaling == "linear":
            return frequencies / self.factor, 1.0
        if self.scaling != "yarn":
            return frequencies, 1.0

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.params.get("beta_fast", 32.0))), 0)
        high: float = min(math.ceil(correction_dim(self.params.get("beta_slow", 1.0))), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((pair - low) / (high - low)).clamp(0, 1)
        scale = 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        return frequencies * (1 - ramp) + frequencies / self.factor * ramp, scale

    def rotation(self, positions: Tensor) -> Rotation:
        needed = int(positions.max()) + 1 if positions.numel() else 0
        frequencies, scale = self.frequencies(needed, positions.device)
        angles = positions.to(torch.float64).unsqueeze(-1) * frequencies  # [B, T, rot/2]
        cos, sin = angles.cos() * scale, angles.sin() * scale
        cos, sin = torch.cat((cos, cos), dim=-1).float(), torch.cat((sin, sin), dim=-1).float()
        return cos.unsqueeze(1), sin.unsqueeze(1)


def alibi_slopes(n_heads: int) -> Tensor:
    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class Alibi(Scheme):
    def bias(self, queries: Tensor, keys: Tensor) -> Tensor:
        distance = (queries.unsqueeze(-1) - keys.unsqueeze(1)).unsqueeze(1)  # [B, 1, Tq, Tk]
        slopes = alibi_slopes(self.config.n_heads) * self.params.get("scale", 1.0)
        slopes = slopes.to(queries.device).view(1, -1, 1, 1)
        return -slopes * distance.to(torch.float32)


class T5(Scheme):
    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        self.buckets = params.get("num_buckets", 32)
        self.max_distance = params.get("max_distance", 128)
        self.bias_table = nn.Parameter(torch.zeros(self.buckets, config.n_heads))

    def bias(self, queries: Tensor, keys: Tensor) -> Tensor:
        distance = (queries.unsqueeze(-1) - keys.unsqueeze(1)).clamp(min=0)  # [B, Tq, Tk]
        exact = self.buckets // 2
        ratio = distance.clamp(min=1).float() / exact
        log_ratio = torch.log(ratio) / math.log(self.max_distance / exact)
        large = (exact + (log_ratio * (self.buckets - exact)).long()).clamp(max=self.buckets - 1)
        buckets = torch.where(distance < exact, distance, large)
        return self.bias_table[buckets].permute(0, 3, 1, 2)


SCHEMES: dict[str, type[Scheme]] = {
    "none": Scheme,
    "integer": Integer,
    "binary": Binary,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rope": Rope,
    "alibi": Alibi,
    "t5": T5,
    "mds": Mds,
    "lowrank": LowRank,
}


# ----------------------------------------------------------------------------------------------
# The transformer


def make_norm(config: OrdinalConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model)
    return nn.LayerNorm(config.d_model, bias=config.bias)


def apply_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] dims of ``x`` [B, H, T, hd] pair by pair (NeoX layout)."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    out = rotated * cos.to(x.dtype) + torch.cat((-second, first), dim=-1) * sin.to(x.dtype)
    return torch.cat((out, passed), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: OrdinalConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.head_dim = config.n_heads, config.d_model // config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.qk_norm = (
            nn.Parameter(torch.ones(2, 1, 1, 1, self.head_dim)) if config.qk_norm else None
        )

    def forward(
        self, x: Tensor, rotation: Rotation | None, mask: Tensor, cache: DynamicCache | None
    ) -> Tensor:
        """``x`` [B, T, d]; ``mask`` [B, 1|H, T, Tk] additive → [B, T, d]."""
        batch, length, width = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, B, H, T, hd]
        if self.qk_norm is not None:
            qkv = torch.cat([F.rms_norm(qkv[:2], (self.head_dim,)) * self.qk_norm, qkv[2:]])
        queries, keys, values = qkv
        if rotation is not None:
            queries, keys = apply_rotation(qkv[:2], *rotation)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))


class FeedForward(nn.Module):
    def __init__(self, config: OrdinalConfig) -> None:
        super().__init__()
        self.kind = config.mlp
        expanded = 2 * config.d_ff if config.mlp == "swiglu" else config.d_ff
        self.up = nn.Linear(config.d_model, expanded, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.up(x)
        if self.kind == "swiglu":
            gate, value = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * value
        elif self.kind == "relu2":
            hidden = F.relu(hidden).square()
        else:
            hidden = F.gelu(hidden, approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return self.down(hidden)


class Block(nn.Module):
    def __init__(self, config: OrdinalConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config, layer)
        self.mlp_norm = make_norm(config)
        self.mlp = FeedForward(config)

    def forward(self, x: Tensor, *attention_inputs: Any) -> Tensor:
        x = x + self.attention(self.attention_norm(x), *attention_inputs)
        return x + self.mlp(self.mlp_norm(x))


class OrdinalForCausalLM(PreTrainedModel, GenerationMixin):
    config: OrdinalConfig
    config_class = OrdinalConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _supports_sdpa = True
    _no_split_modules = ["Block"]  # noqa: RUF012 (PreTrainedModel's own class attribute)

    def __init__(self, config: OrdinalConfig) -> None:
        super().__init__(config)
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        positional = dict(config.positional)
        self.positional = SCHEMES[positional.pop("scheme")](config, positional)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.final_norm = make_norm(config)
        # Tied: the logits reuse the embedding matrix (no second parameter to tie or load).
        self.lm_head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.token_embedding

    def set_input_embeddings(self, value: nn.Module) -> None:
        assert isinstance(value, nn.Embedding)
        self.token_embedding = value

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: DynamicCache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """``input_ids`` [B, T] (continuing ``past_key_values``) → logits [B, T, vocab].

        ``attention_mask`` [B, past + T] (1 = a real token) gives each row its positions and
        keeps padding out of attention; without it every row is unpadded.
        """
        if cache is None:  # the name transformers before 5.x passes it under
            cache = kwargs.get("past_key_values")
        if cache is None and (
            getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        ):
            cache = DynamicCache()
        batch, length = input_ids.shape
        device = input_ids.device
        past = cache.get_seq_length() if cache is not None else 0
        total = past + length
        if attention_mask is None:
            real = torch.ones(batch, total, dtype=torch.bool, device=device)
            key_positions = torch.arange(total, device=device).expand(batch, total)
            positions = key_positions[:, past:] if position_ids is None else position_ids
        else:  # a position counts the real tokens before it, so padding takes none
            real = attention_mask[:, -total:].to(torch.bool)
            key_positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # [B, Tk]
            positions = key_positions[:, past:]

        x = self.token_embedding(input_ids)
        vectors = self.positional.embedding(positions)
        if vectors is not None:
            x = x + vectors.to(x.dtype)
        rotation = self.positional.rotation(positions)

        # Query i (slot past + i) sees the real keys in slots up to its own; a query that sees
        # none (left padding) sees itself, so no row of the softmax is empty.
        slots = torch.arange(total, device=device)
        query_slots = (past + torch.arange(length, device=device)).unsqueeze(-1)  # [T, 1]
        allowed = ((slots <= query_slots) & real[:, None, :]) | (slots == query_slots)
        allowed = allowed.unsqueeze(1)  # [B, 1, T, Tk]
        bias = self.positional.bias(positions, key_positions)
        scores = torch.zeros(allowed.shape, dtype=x.dtype, device=device)
        if bias is not None:
            scores = scores + bias.to(x.dtype)
        mask = scores.masked_fill(~allowed, float("-inf"))

        for block in self.blocks:
            x = block(x, rotation, mask, cache)
        x = self.final_norm(x)
        weight = self.token_embedding.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        # positional: the cache's field is `cache` in transformers 5.x, `past_key_values` before
        return CausalLMOutputWithPast(loss, logits, cache)
