"""Tokenizer and chat template, read by transformers from the GGUF file or HF directory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    """A thin wrapper over a transformers tokenizer: encode, decode, chat template, EOS ids."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        from transformers import AutoTokenizer

        path = Path(path)
        return cls(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> Tokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(directory)))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the special tokens the model's tokenizer config adds."""
        return list(self.hf(text)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation rendered by the model's own chat template."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return list(self.hf(text, add_special_tokens=False)["input_ids"])
