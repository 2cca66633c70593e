"""ordinal's decoder for Hugging Face Transformers: a self-contained port (torch and transformers
only), loaded with ``trust_remote_code=True``.

The same model as ordinal's ``model/transformer.py`` with the same parameter names, so the folder's
model.safetensors holds ordinal's own tensors: token embedding → positional scheme → pre-norm blocks
(fused QKV attention, MLP) → final norm → logits. Each of ordinal's positional schemes is here, as
the small class ordinal has in ``model/positional/``: an added vector (none, integer, binary,
sinusoidal, learned, mds, lowrank), a rotation of queries and keys (rope, with p-RoPE's ``fraction``
and its context extensions; pope's polar turn, whose queries and keys are twice a head's width), a
bias on the scores from positions (alibi, t5, fire), a bias each layer computes from its own queries
and keys (fox, cope), rope in some layers only (irope: the others NoPE, with Llama 4's attention
temperature), weights other than softmax's (stick-breaking), or keys turned by the tokens after
them (path, pathfox).

Positions follow the attention mask (position = how many real tokens came before), so left-padded
batches in ``generate()`` get the positions each row would have alone; keys and values are kept in a
transformers ``DynamicCache`` (pope's keys as turned, twice the values' width), and so are fox's
per-token log forget gates (:func:`update_cache`). This file was copied from ordinal
(interop/remote/) by ``ordinal export``.
"""

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_ordinal import OrdinalConfig

Rotation = tuple[Tensor, Tensor]  # (cos, sin), each [B, 1, T, rotary_dim]


# ----------------------------------------------------------------------------------------------
# Positional schemes. Each fills the hooks that carry its positions, once per pass:
#   embedding(positions [B, T]) → [B, T, d] | None: a vector added to the token embeddings;
#   rotation(positions [B, T]) → Rotation | None: queries and keys turned, each layer by
#   turn(queries_keys [2, B, H, T, hd], rotation, layer) → [2, B, H, T, hd · key_width_factor];
#   bias(q_positions [B, Tq], k_positions [B, Tk]) → [B, H, Tq, Tk] | None: added to the scores;
# or, a data-dependent scheme (fox, cope), in each layer from what that layer sees:
#   key_state(layer, hidden [B, T, d]) → [B, H, T] | None: per-token scalars later queries need;
#   layer_bias(layer, queries, keys, key_state, allowed) → [B, H, Tq, Tk] | None.
# A schedule (irope) says which layers get the hooks above; the others attend as NoPE's:
#   acts_at(layer) → bool;
#   query_scale(positions [B, T]) → [B, 1, T, 1] | None: a factor on those layers' queries.
# A scheme that replaces softmax (stick-breaking: ``replaces_softmax``) weighs the values itself:
#   attention_weights(scores [B, H, Tq, Tk], allowed [B, 1, Tq, Tk]) → [B, H, Tq, Tk].
# A scheme that turns keys by the tokens after them (PaTH: ``rewrites_keys``):
#   move_keys(layer, hidden, queries, keys, before, new_tokens) → (bias, keys after the pass).


class Scheme(nn.Module):
    """No positional signal (NoPE); the base every scheme below changes one hook of."""

    replaces_softmax = False  # True: attention_weights, not SDPA's softmax, weighs the values
    rewrites_keys = False  # True: move_keys turns the keys, and the cache keeps them turned
    key_width_factor = 1  # how many times a head's width its turned keys (and cached ones) are

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.params = params

    def embedding(self, positions: Tensor) -> Tensor | None:
        return None

    def rotation(self, positions: Tensor) -> Rotation | None:
        return None

    def turn(self, queries_keys: Tensor, rotation: Rotation, layer: int) -> Tensor:
        """Queries and keys ``queries_keys`` [2, B, H, T, hd] of layer ``layer`` turned by
        ``rotation`` → [2, B, H, T, hd · key_width_factor]: rope's pairs here."""
        return apply_rotation(queries_keys, *rotation)

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        return None

    def key_state(self, layer: int, hidden: Tensor) -> Tensor | None:
        return None

    def layer_bias(
        self, layer: int, queries: Tensor, keys: Tensor, key_state: Tensor | None, allowed: Tensor
    ) -> Tensor | None:
        """``queries`` [B, H, Tq, hd], ``keys`` [B, H, Tk, hd] (the cached ones included),
        ``key_state`` [B, H, Tk], ``allowed`` [B, 1, Tq, Tk] bool (where a query may look)."""
        return None

    def move_keys(
        self,
        layer: int,
        hidden: Tensor,
        queries: Tensor,
        keys: Tensor,
        before: Tensor,
        new_tokens: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Only where ``rewrites_keys`` (PaTH): see Path.move_keys."""
        raise NotImplementedError

    def acts_at(self, layer: int) -> bool:
        """Whether layer ``layer`` gets the hooks above (else it attends as NoPE's)."""
        return True

    def query_scale(self, positions: Tensor) -> Tensor | None:
        """A factor on the queries at ``positions`` [B, T] → [B, 1, T, 1] in the layers this
        scheme leaves out, or None."""
        return None

    def attention_weights(self, scores: Tensor, allowed: Tensor) -> Tensor:
        """Each query's weights over its keys [B, H, Tq, Tk] from ``scores`` (q·k/√hd plus any
        bias) where ``allowed`` [B, 1, Tq, Tk], 0 elsewhere: softmax, unless replaces_softmax."""
        return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)


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
    or yarn as ordinal's model/positional/rope.py (Hugging Face's definitions). ``fraction``
    (p-RoPE) keeps the fastest kept_pairs pairs turning and leaves the slowest where they are."""

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        head_dim = config.d_model // config.n_heads
        self.rotary_dim = int(head_dim * params.get("rotary_fraction", 1.0)) // 2 * 2
        self.kept_pairs = int(params.get("fraction", 1.0) * self.rotary_dim // 2)
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
        cos[..., self.kept_pairs :], sin[..., self.kept_pairs :] = 1.0, 0.0  # p-RoPE: unturned
        cos, sin = torch.cat((cos, cos), dim=-1).float(), torch.cat((sin, sin), dim=-1).float()
        return cos.unsqueeze(1), sin.unsqueeze(1)


class Interleaved(Rope):
    """iRoPE: rope (every option above) in the layers ``layers`` names ``rope``, a pattern such
    as ``rope,rope,rope,none`` repeated over the layers; the ``none`` layers are NoPE (Hugging
    Face's Llama 4 calls them ``no_rope_layers``). A rope layer sees only its last ``window``
    keys when that is set; a NoPE layer's queries are scaled by Llama 4's attention temperature
    log(⌊(p + 1) / temperature_floor⌋ + 1) · temperature_scale + 1 when temperature_floor is."""

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        pattern = [kind.strip() for kind in params.get("layers", "rope,rope,rope,none").split(",")]
        self.rope_layers = {
            layer for layer in range(config.n_layers) if pattern[layer % len(pattern)] == "rope"
        }

    def acts_at(self, layer: int) -> bool:
        return layer in self.rope_layers

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        window = self.params.get("window")
        if window is None:
            return None
        distance = q_positions.unsqueeze(-1) - k_positions.unsqueeze(1)  # [B, Tq, Tk]
        outside = torch.zeros(distance.shape, device=distance.device)
        return outside.masked_fill(distance >= window, float("-inf")).unsqueeze(1)

    def query_scale(self, positions: Tensor) -> Tensor | None:
        floor = self.params.get("temperature_floor")
        if floor is None:
            return None
        steps = torch.floor((positions.to(torch.float32) + 1) / floor)
        scale = torch.log(steps + 1) * self.params.get("temperature_scale", 0.1) + 1  # [B, T]
        return scale[:, None, :, None]


class Polar(Scheme):
    """PoPE, polar coordinate positions: each component c of a head becomes the complex number
    of magnitude softplus(x_c) at phase p·θ_c, θ_c = base^(−c/hd), a key's phase moved by a
    learned δ (per layer, head and component, clamped to [−2π, 0]); written as its (cos, sin)
    parts, so queries and keys are twice a head's width and q·k is
    Σ_c |q_c|·|k_c|·cos((s − t)·θ_c − δ_c). Queries × √2, so SDPA's 1/√(2·hd) is 1/√hd."""

    key_width_factor = 2

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        head_dim = config.d_model // config.n_heads
        self.base = params.get("base", 10000.0)
        self.phase_bias = nn.Parameter(torch.zeros(config.n_layers, config.n_heads, head_dim))

    def rotation(self, positions: Tensor) -> Rotation:
        """cos/sin of each component's phase p·θ_c → each [B, 1, T, hd] (float64 angles)."""
        head_dim = self.phase_bias.shape[-1]
        exponents = torch.arange(head_dim, device=positions.device, dtype=torch.float64)
        angles = positions.to(torch.float64).unsqueeze(-1) * self.base ** (-exponents / head_dim)
        return angles.cos().float().unsqueeze(1), angles.sin().float().unsqueeze(1)

    def turn(self, queries_keys: Tensor, rotation: Rotation, layer: int) -> Tensor:
        cos, sin = (part.to(queries_keys.dtype) for part in rotation)  # [B, 1, T, hd]
        queries, keys = F.softplus(queries_keys)  # the magnitudes, [B, H, T, hd] each
        delta = self.phase_bias[layer].clamp(-2 * math.pi, 0.0)[None, :, None, :]  # [1, H, 1, hd]
        key_cos = cos * delta.cos() - sin * delta.sin()  # cos(tθ + δ)
        key_sin = sin * delta.cos() + cos * delta.sin()  # sin(tθ + δ)
        turned_queries = torch.cat([queries * cos, queries * sin], dim=-1) * math.sqrt(2)
        turned_keys = torch.cat([keys * key_cos, keys * key_sin], dim=-1)
        return torch.stack([turned_queries, turned_keys.to(turned_queries.dtype)])


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
    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        distance = (q_positions.unsqueeze(-1) - k_positions.unsqueeze(1)).unsqueeze(1)
        slopes = alibi_slopes(self.config.n_heads) * self.params.get("scale", 1.0)
        slopes = slopes.to(q_positions.device).view(1, -1, 1, 1)
        return -slopes * distance.to(torch.float32)


class T5(Scheme):
    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        self.buckets = params.get("num_buckets", 32)
        self.max_distance = params.get("max_distance", 128)
        self.bias_table = nn.Parameter(torch.zeros(self.buckets, config.n_heads))

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        distance = (q_positions.unsqueeze(-1) - k_positions.unsqueeze(1)).clamp(min=0)
        exact = self.buckets // 2
        ratio = distance.clamp(min=1).float() / exact
        log_ratio = torch.log(ratio) / math.log(self.max_distance / exact)
        large = (exact + (log_ratio * (self.buckets - exact)).long()).clamp(max=self.buckets - 1)
        buckets = torch.where(distance < exact, distance, large)
        return self.bias_table[buckets].permute(0, 3, 1, 2)


class Fire(Scheme):
    """FIRE: b_h(i, j) = MLP(ψ(i − j) / ψ(max(L, i)))_h, a learned function of the log
    distance ψ(x) = log(|c|·x + 1) over that of the query's position, floored at a learned
    threshold L; c and L's multiplier are learned. ``log_transform`` False: ψ(x) = x;
    ``normalise`` False: the MLP reads ψ(i − j) itself."""

    EPSILON = 1e-6  # keeps the divisor away from 0

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        hidden = params.get("hidden", 32)
        self.mlp_in = nn.Linear(1, hidden)
        self.mlp_out = nn.Linear(hidden, config.n_heads)
        self.c = nn.Parameter(torch.tensor(params.get("c", 0.1)))
        self.threshold = params.get("threshold") or config.context_length / 4
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))

    def psi(self, x: Tensor) -> Tensor:
        return torch.log(self.c.abs() * x + 1) if self.params.get("log_transform", True) else x

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        query = q_positions.unsqueeze(-1).float()  # [B, Tq, 1]
        distance = (query - k_positions.unsqueeze(1).float()).clamp(min=0)  # later keys: masked
        inputs = self.psi(distance)  # [B, Tq, Tk]
        if self.params.get("normalise", True):
            threshold = (self.threshold_scale * self.threshold).abs()
            inputs = inputs / (self.psi(torch.maximum(query, threshold)) + self.EPSILON)
        hidden = torch.relu(self.mlp_in(inputs.unsqueeze(-1).to(self.mlp_in.weight.dtype)))
        return self.mlp_out(hidden).permute(0, 3, 1, 2)  # [B, Tq, Tk, H] → [B, H, Tq, Tk]


def sum_back_to_each_key(values: Tensor, allowed: Tensor) -> Tensor:
    """For each query i and key j, the sum of ``values`` [B, H, Tq|1, Tk] over the keys t ≥ j
    that i may see (``allowed`` [B, 1, Tq, Tk]) → [B, H, Tq, Tk]. Summed from the query's last
    visible key back, so keys it may not see (later slots, padding) add exact zeros."""
    return torch.where(allowed, values, 0.0).flip(-1).cumsum(-1).flip(-1)


class Fox(Scheme):
    """FoX, the Forgetting Transformer: each layer and head gates every token,
    f_t = σ(w·x_t + b) from the layer's normalised input, and query i's score for key j gets
    Σ_{l=j+1..i} log f_l (a key forgets by every token after it). The log gates are each
    token's key state, kept in the cache beside its key."""

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        layers, heads = config.n_layers, config.n_heads
        self.gate_weight = nn.Parameter(torch.zeros(layers, heads, config.d_model))
        self.gate_bias = nn.Parameter(torch.zeros(layers, heads))

    def key_state(self, layer: int, hidden: Tensor) -> Tensor:
        """log f_t → [B, H, T], in float32 (it is summed over many tokens)."""
        weight, bias = self.gate_weight[layer].float(), self.gate_bias[layer].float()
        return F.logsigmoid(F.linear(hidden.float(), weight, bias)).transpose(1, 2)

    def layer_bias(
        self, layer: int, queries: Tensor, keys: Tensor, key_state: Tensor | None, allowed: Tensor
    ) -> Tensor:
        assert key_state is not None  # every layer is handed its keys' log gates
        from_key = sum_back_to_each_key(key_state.unsqueeze(-2), allowed)  # Σ over l ≥ j
        return F.pad(from_key[..., 1:], (0, 1))  # Σ over l > j (nothing after the last key)


class Cope(Scheme):
    """CoPE, contextual positions: query i counts key j's position as p_ij = Σ_{t=j..i}
    σ(q_i·k_t/√hd) over the keys it may see, and its score gets q_i·e[p_ij], e read between
    the rows ⌊p⌋ and ⌈p⌉ of the layer's table (clamped to its last row)."""

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        rows = params.get("n_positions") or config.context_length
        self.table = nn.Parameter(
            torch.zeros(config.n_layers, rows, config.d_model // config.n_heads)
        )

    def layer_bias(
        self, layer: int, queries: Tensor, keys: Tensor, key_state: Tensor | None, allowed: Tensor
    ) -> Tensor:
        table = self.table[layer].float()  # [n, hd]
        queries, keys = queries.float(), keys.float()  # a running count needs float32
        gates = (queries @ keys.transpose(-2, -1) / math.sqrt(queries.shape[-1])).sigmoid()
        positions = sum_back_to_each_key(gates, allowed).clamp(max=table.shape[0] - 1)
        at_rows = queries @ table.T  # [B, H, Tq, n]: q_i·e[k] for every row k
        below, above = positions.floor().long(), positions.ceil().long()
        weight = positions - below
        return at_rows.gather(-1, above) * weight + at_rows.gather(-1, below) * (1 - weight)


class StickBreaking(Scheme):
    """Stick-breaking attention: no positions, and no softmax. Key j takes the share
    β_ij = σ(q_i·k_j/√hd) of what the keys after it (up to the query's own) left,
    A_ij = β_ij · ∏_{j<t≤i} (1 − β_it), computed in log space from the query's key back."""

    replaces_softmax = True

    def attention_weights(self, scores: Tensor, allowed: Tensor) -> Tensor:
        scores = scores.float()
        kept = F.logsigmoid(-scores)  # log(1 − β): what each later key leaves of the stick
        later = sum_back_to_each_key(kept, allowed) - kept.where(allowed, 0.0)
        return (F.logsigmoid(scores) + later).exp().where(allowed, 0.0)


# PaTH's tokens per block (ordinal's model/positional/path.py BLOCK).
PATH_BLOCK = 32


class Path(Scheme):
    """PaTH: each token t turns every key before it by H_t = I − β_t·w_t·w_tᵀ, w_t a unit
    direction and β_t = 2·σ(u·x_t + b) from the layer's normalised input, so query i scores key
    j by q_iᵀ·H_i⋯H_{j+1}·k_j. A pass's effect is solved block by block of PATH_BLOCK tokens,
    each one unit lower-triangular system (the UT transform), and the cache keeps every key
    turned by all the tokens after it (``move_keys``; rewrite_cached_keys)."""

    rewrites_keys = True

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        layers, heads, width = config.n_layers, config.n_heads, config.d_model
        self.direction_weight = nn.Parameter(torch.zeros(layers, width, width))
        self.strength_weight = nn.Parameter(torch.zeros(layers, heads, width))
        self.strength_bias = nn.Parameter(torch.zeros(layers, heads))

    def move_keys(
        self,
        layer: int,
        hidden: Tensor,
        queries: Tensor,
        keys: Tensor,
        before: Tensor,
        new_tokens: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """``hidden`` [B, n, d] the new tokens, ``queries`` [B, H, n, hd] theirs, ``keys``
        [B, H, Tk, hd] as cached (the new ones raw), ``before`` [B, 1, n, Tk] key j precedes
        token s, ``new_tokens`` [B, n] (False: padding, which turns nothing) → the score bias
        [B, H, n, Tk] on q·k/√hd, and every key after the pass [B, H, Tk, hd]."""
        batch, n, _ = hidden.shape
        w = F.linear(hidden, self.direction_weight[layer]).view(batch, n, self.config.n_heads, -1)
        w = F.normalize(w.transpose(1, 2).float(), dim=-1)  # [B, H, n, hd]
        beta = 2 * torch.sigmoid(
            F.linear(hidden, self.strength_weight[layer], self.strength_bias[layer])
        )
        beta = (beta.float().transpose(1, 2) * new_tokens.unsqueeze(1)).unsqueeze(-1)
        queries, keys, moved, biases = queries.float(), keys.float(), keys.float(), []
        for start in range(0, n, PATH_BLOCK):  # ordinal's blocks, for the same rounding
            block = slice(start, start + PATH_BLOCK)
            wb, bb, qb = w[..., block, :], beta[..., block, :], queries[..., block, :]
            size = wb.shape[-2]
            lower = torch.ones(size, size, dtype=torch.bool, device=hidden.device)
            between = (bb * (wb @ wb.transpose(-2, -1))).masked_fill(~lower.tril(-1), 0.0)
            right = (bb * (wb @ moved.transpose(-2, -1))).masked_fill(~before[..., block, :], 0.0)
            system = torch.eye(size, device=hidden.device) + between
            shares = torch.linalg.solve_triangular(system, right, upper=False, unitriangular=True)
            reach = (qb @ wb.transpose(-2, -1)).masked_fill(~lower.tril(), 0.0)  # s ≤ i
            bias = -(reach @ shares)
            if start > 0:  # what the earlier blocks did to the keys this block's queries see
                bias = bias + qb @ (moved - keys).transpose(-2, -1)
            biases.append(bias)
            moved = moved - shares.transpose(-2, -1) @ wb
        return torch.cat(biases, dim=-2) / math.sqrt(queries.shape[-1]), moved


class PathFox(Path):
    """PaTH-FoX: PaTH's transitions and FoX's forget gates on the same scores."""

    def __init__(self, config: OrdinalConfig, params: dict[str, Any]) -> None:
        super().__init__(config, params)
        self.forgetting = Fox(config, {})

    def key_state(self, layer: int, hidden: Tensor) -> Tensor:
        return self.forgetting.key_state(layer, hidden)

    def layer_bias(
        self, layer: int, queries: Tensor, keys: Tensor, key_state: Tensor | None, allowed: Tensor
    ) -> Tensor:
        return self.forgetting.layer_bias(layer, queries, keys, key_state, allowed)


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
    "fox": Fox,
    "cope": Cope,
    "fire": Fire,
    "irope": Interleaved,
    "stickbreaking": StickBreaking,
    "pope": Polar,
    "path": Path,
    "pathfox": PathFox,
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


def rewrite_cached_keys(cache: DynamicCache, layer: int, keys: Tensor) -> None:
    """Layer ``layer``'s cached keys become ``keys`` [B, H, Tk, hd] (PaTH's, turned by the
    pass), in place: a key state kept as one more channel (update_cache) stays."""
    stored = getattr(cache.layers[layer], "keys", None)  # a DynamicLayer's
    assert stored is not None  # this pass has just appended its keys
    stored[..., : keys.shape[-1]] = keys.to(stored.dtype)


class PassInputs(NamedTuple):
    """What one layer of a pass reads besides its input."""

    scheme: Scheme | None  # None: a layer the scheme's schedule leaves out (it attends as NoPE)
    rotation: Rotation | None
    allowed: Tensor  # [B, 1, T, Tk] bool: where each query may look
    mask: Tensor  # [B, 1|H, T, Tk] additive: the scheme's position bias, −inf where not allowed
    cache: DynamicCache | None
    query_scale: Tensor | None = None  # [B, 1, T, 1]: the scheme's, in a layer it leaves out
    before: Tensor | None = None  # [B, 1, T, Tk] bool: key j precedes new token s (PaTH)
    new_tokens: Tensor | None = None  # [B, T] bool: the pass's tokens that are not padding


def update_cache(
    cache: DynamicCache, layer: int, keys: Tensor, values: Tensor, key_state: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Append this pass's ``keys``, ``values`` [B, H, T, hd] and ``key_state`` [B, H, T] (or
    None) to layer ``layer``'s cache → all of them so far, [B, H, Tk, hd] and [B, H, Tk].

    A key state is kept as one more channel of its key, so whatever generate() does to the
    cache (crop it, reorder beams, select rows) keeps each token's state with its key. It is
    stored in the keys' dtype (float32, ordinal's, when the model is loaded in float32).
    """
    if key_state is None:
        keys, values = cache.update(keys, values, layer)
        return keys, values, None
    with_state = torch.cat((keys, key_state.unsqueeze(-1).to(keys.dtype)), dim=-1)
    stored, values = cache.update(with_state, values, layer)
    return stored[..., :-1], values, stored[..., -1]


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

    def forward(self, x: Tensor, inputs: PassInputs) -> Tensor:
        """``x`` [B, T, d] (normalised) → [B, T, d]; a data-dependent scheme adds its bias, and
        a scheme that replaces softmax weighs the values itself."""
        batch, length, width = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, B, H, T, hd]
        if self.qk_norm is not None:
            qkv = torch.cat([F.rms_norm(qkv[:2], (self.head_dim,)) * self.qk_norm, qkv[2:]])
        queries, keys, values = qkv
        scheme, allowed = inputs.scheme, inputs.allowed
        if inputs.rotation is not None:  # pope's: twice a head's width, and so the cached keys
            assert scheme is not None  # a pass's rotation comes with its scheme
            queries, keys = scheme.turn(qkv[:2], inputs.rotation, self.layer)
        if inputs.query_scale is not None:
            queries = queries * inputs.query_scale.to(queries.dtype)
        key_state = None if scheme is None else scheme.key_state(self.layer, x)  # [B, H, T]
        if inputs.cache is not None:
            keys, values, key_state = update_cache(
                inputs.cache, self.layer, keys, values, key_state
            )
        mask = inputs.mask
        if scheme is not None:
            bias = scheme.layer_bias(self.layer, queries, keys, key_state, allowed)
            if bias is not None:
                mask = mask + bias.to(mask.dtype)
        moved = None
        if scheme is not None and scheme.rewrites_keys:
            assert inputs.before is not None and inputs.new_tokens is not None
            turned, moved = scheme.move_keys(
                self.layer, x, queries, keys, inputs.before, inputs.new_tokens
            )
            mask = mask + turned.to(mask.dtype)
        if scheme is not None and scheme.replaces_softmax:  # in float32, as ordinal's
            scores = queries.float() @ keys.float().transpose(-2, -1) / math.sqrt(self.head_dim)
            scores = scores + mask.float().where(allowed, 0.0)  # [B, H, T, Tk]
            out = scheme.attention_weights(scores, allowed).to(values.dtype) @ values
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        if moved is not None and inputs.cache is not None:  # once attention has read them
            rewrite_cached_keys(inputs.cache, self.layer, moved)
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

    def forward(self, x: Tensor, inputs: PassInputs) -> Tensor:
        x = x + self.attention(self.attention_norm(x), inputs)
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
        causal = torch.zeros(allowed.shape, dtype=x.dtype, device=device)
        causal = causal.masked_fill(~allowed, float("-inf"))
        bias = self.positional.bias(positions, key_positions)
        mask = causal if bias is None else causal + bias.to(x.dtype)

        scheme = self.positional
        before = (slots < query_slots).unsqueeze(0).unsqueeze(0)  # [1, 1, T, Tk]
        kept = PassInputs(
            scheme, rotation, allowed, mask, cache, before=before, new_tokens=real[:, past:]
        )
        # A layer the scheme's schedule leaves out: causality alone, and its query scale.
        left_out = PassInputs(None, None, allowed, causal, cache, scheme.query_scale(positions))
        for layer, block in enumerate(self.blocks):
            x = block(x, kept if scheme.acts_at(layer) else left_out)
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
