"""Hugging Face's ``apply_chat_template``, with its defaults, on a shipped tokenizer folder gives
the scene the server prompts with: the same token ids, <|bos|> first, each <|eos|> a special
id (lm-evaluation-harness's ``--apply_chat_template`` renders this way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from model.chat import TOKENIZER_CONFIG_FILE, ChatTemplate, Message, default_tokenizer_config
from model.tokenizer import encode_prompt, load_tokenizer, special_ids

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"
FOLDERS = sorted(folder for folder in SHIPPED.iterdir() if (folder / "tokenizer.json").is_file())
CONVERSATIONS = [
    [{"role": "user", "content": "What light through yonder window breaks?"}],
    [
        {"role": "system", "content": "Verona. A public place."},
        {"role": "user", "content": "Good morrow, cousin.", "name": "Benvolio"},
        {"role": "assistant", "content": "Is the day so young?", "name": "Romeo"},
        {"role": "user", "content": "But new struck nine."},
    ],
    [
        {"role": "developer", "content": "Elsinore."},
        {"role": "assistant", "content": "Who's there?"},
        {"role": "user", "content": "Nay, answer me.", "name": "FRANCISCO"},
    ],
]


def server_scene(folder: Path, conversation: list[dict[str, str]]) -> list[int]:
    """The prompt ids the server's chat endpoint builds (server.api.chat: developer → system)."""
    messages = [
        Message("system" if m["role"] == "developer" else m["role"], m["content"], m.get("name"))
        for m in conversation
    ]
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    return ChatTemplate.from_checkpoint(folder).encode(tokenizer, messages).prompt_ids


@pytest.mark.parametrize("folder", FOLDERS, ids=[folder.name for folder in FOLDERS])
def test_apply_chat_template_renders_the_servers_scene(folder: Path) -> None:
    hf = AutoTokenizer.from_pretrained(folder)
    assert (hf.bos_token, hf.eos_token) == ("<|bos|>", "<|eos|>")
    for conversation in CONVERSATIONS:
        ids = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert list(ids) == server_scene(folder, conversation), conversation


@pytest.mark.parametrize("folder", FOLDERS, ids=[folder.name for folder in FOLDERS])
def test_shipped_tokenizer_config_is_the_default(folder: Path) -> None:
    config = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text())
    assert config == default_tokenizer_config()


TEXTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "Ça va, naïve café — ¿sí? 🎭\n\n  two spaces",
    " a leading space",
]


@pytest.mark.parametrize("folder", FOLDERS, ids=[folder.name for folder in FOLDERS])
def test_auto_tokenizer_encodes_a_text_as_the_server_prompts_it(folder: Path) -> None:
    """``AutoTokenizer`` with its defaults gives a text the server's prompt ids, <|bos|> first
    (the shipped tokenizer.json's post-processor); ordinal's own tokenizer adds it once."""
    hf = AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(folder / "tokenizer.json")
    for text in TEXTS:
        prompt = encode_prompt(ours, text)
        assert prompt[0] == special_ids(ours).bos and prompt[1] != prompt[0]  # one bos, not two
        assert hf(text)["input_ids"] == prompt, text
        assert hf(text, add_special_tokens=False)["input_ids"] == prompt[1:]
        assert hf.decode(prompt, skip_special_tokens=True) == text
