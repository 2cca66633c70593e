"""ordinal's model configuration for Hugging Face Transformers (``trust_remote_code=True``).

The fields are ordinal's ``ModelConfig`` as its config.json writes them (``positional`` is the
scheme and its parameters); ``attribute_map`` gives them the names Transformers looks for.
This file was copied from ordinal (interop/remote/) by ``ordinal export``.
"""

from typing import Any

from transformers import PretrainedConfig


class OrdinalConfig(PretrainedConfig):
    model_type = "ordinal"
    attribute_map = {  # noqa: RUF012 (PretrainedConfig's own class attribute)
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "intermediate_size": "d_ff",
        "max_position_embeddings": "max_context",
    }

    def __init__(
        self,
        vocab_size: int = 2048,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        d_ff: int = 512,
        context_length: int = 128,
        max_positions: int = 512,
        max_context: int = 512,
        norm: str = "layernorm",
        mlp: str = "gelu",
        bias: bool = False,
        tie_embeddings: bool = True,
        qk_norm: bool = False,
        positional: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.d_ff = d_ff
        self.context_length = context_length
        self.max_positions = max_positions
        self.max_context = max_context  # how far ordinal serves it (not a limit of the port)
        self.norm = norm
        self.mlp = mlp
        self.bias = bias
        self.tie_embeddings = tie_embeddings
        self.qk_norm = qk_norm
        self.positional = positional or {"scheme": "rope"}
        kwargs.setdefault("tie_word_embeddings", tie_embeddings)
        super().__init__(**kwargs)
