"""Tiny Hugging Face models built locally with ``transformers`` (random weights, a byte-level
BPE tokenizer trained here, ``save_pretrained``; nothing from the hub), for the import tests and
the README's "Bring a model" commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXT = [
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "All the world's a stage, and all the men and women merely players. Ça va, café?",
]
VOCAB = 320  # ≥ the tokenizer's ~300 tokens


def hf_tokenizer(bos: str, eos: str, add_bos: bool) -> Any:
    """A byte-level BPE trained on TEXT, as transformers wraps and saves one; with ``add_bos``
    a post-processor that prepends bos (Llama's), which ordinal must not apply twice."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = list(dict.fromkeys([bos, eos]))
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT, trainer=trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=eos
    )


def gpt2(folder: Path) -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,  # <|endoftext|>, the tokenizer's first token
        eos_token_id=0,
    )
    return save(folder, transformers.GPT2LMHeadModel(config), "<|endoftext|>", "<|endoftext|>")


def llama(folder: Path, tie: bool) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: two query heads per key/value head
        intermediate_size=64,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500.0,  # not the default base, so a wrong base shows
        tie_word_embeddings=tie,
    )
    return save(folder, transformers.LlamaForCausalLM(config), "<s>", "</s>", add_bos=True)


def save(folder: Path, model: Any, bos: str, eos: str, add_bos: bool = False) -> Path:
    torch.manual_seed(0)
    with torch.no_grad():  # a wide spread, so logits depend visibly on content and position
        for name, parameter in model.named_parameters():
            if "norm" not in name and "ln_" not in name:
                parameter.normal_(0, 0.15)
            else:
                parameter.uniform_(0.5, 1.5)
    model.eval().save_pretrained(folder)
    hf_tokenizer(bos, eos, add_bos).save_pretrained(folder)
    return folder
