"""A Hugging Face fast tokenizer (``tokenizer.json``), loaded with the ``tokenizers`` library.

``--tokenizer-model`` names either a ``tokenizer.json`` file or a folder holding one. In a
folder, ``tokenizer_config.json`` and ``special_tokens_map.json`` (the latter wins, as in
Hugging Face) supply the eos/bos/pad/mask token names; a lone file has no such names, so the
special ids are found by the usual token names instead.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional

from tokenizers import Tokenizer

from megatron.training.tokenizer.base import MASK_TOKEN_NAMES, MegatronTokenizer, require_file

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # later files win
_SPECIAL_KEYS = ("eos_token", "bos_token", "pad_token", "mask_token")
# Tried in order when no eos token is configured (GPT-2/NeoX/Qwen base, Llama/Mistral, chat).
_EOD_FALLBACK_NAMES = ("<|endoftext|>", "</s>", "<|im_end|>")


def _resolve_paths(path: Optional[str]) -> tuple:
    """(tokenizer.json path, [config file paths]) for a file or folder ``--tokenizer-model``."""
    if path and os.path.isdir(path):
        tokenizer_file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(tokenizer_file):
            hint = (" (it holds a tokenizer.model: use --tokenizer-type SentencePieceTokenizer)"
                    if os.path.isfile(os.path.join(path, "tokenizer.model")) else "")
            raise FileNotFoundError(f"--tokenizer-model {path}: the folder has no {TOKENIZER_FILE}{hint}")
        configs = [os.path.join(path, name) for name in CONFIG_FILES]
        return tokenizer_file, [c for c in configs if os.path.isfile(c)]
    return require_file(path, "--tokenizer-model", f"Hugging Face {TOKENIZER_FILE} or its folder"), []


def _read_special_token_names(config_files: List[str]) -> Dict[str, str]:
    """eos/bos/pad/mask token strings from the config files (values may be str or AddedToken dicts)."""
    names: Dict[str, str] = {}
    for config_file in config_files:
        try:
            with open(config_file, encoding="utf-8") as handle:
                config = json.load(handle)
        except (OSError, ValueError) as error:
            raise ValueError(f"--tokenizer-model: cannot read {config_file}: {error}") from error
        for key in _SPECIAL_KEYS:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value:
                names[key] = value
    return names


class HuggingFaceTokenizer(MegatronTokenizer):
    """Wraps ``tokenizers.Tokenizer``. ``tokenize`` adds no special tokens (preprocessing
    appends eod itself), and ``detokenize`` keeps special tokens in the text."""

    type_name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str, add_mask_token: bool = False,
                 mask_token: Optional[int] = None) -> None:
        self.tokenizer_file, self.config_files = _resolve_paths(tokenizer_model)
        try:
            self._tokenizer = Tokenizer.from_file(self.tokenizer_file)
        except Exception as error:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"--tokenizer-model {self.tokenizer_file} is not a readable "
                             f"Hugging Face tokenizer file: {error}") from error
        self._special_names = _read_special_token_names(self.config_files)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        # Added tokens may leave gaps, so size by the largest id rather than the entry count.
        self._base_size = max(self._tokenizer.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self._eod = self._find_eod()
        self._init_mask_token(mask_token, add_mask_token)

    def _configured_id(self, key: str) -> Optional[int]:
        name = self._special_names.get(key)
        return self.token_to_id(name) if name is not None else None

    def _find_eod(self) -> int:
        configured = self._configured_id("eos_token")
        if configured is not None:
            return configured
        found = self.first_known_id(_EOD_FALLBACK_NAMES)
        if found is not None:
            return found
        raise ValueError(f"--tokenizer-model {self.tokenizer_file}: no eos token configured and no "
                         f"token named {', '.join(_EOD_FALLBACK_NAMES)}; add eos_token to "
                         f"tokenizer_config.json next to {TOKENIZER_FILE}")

    @property
    def base_vocab_size(self) -> int:
        return self._base_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        configured = self._configured_id("pad_token")
        return configured if configured is not None else self.eod

    @property
    def bos(self) -> Optional[int]:
        return self._configured_id("bos_token")

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tokenizer.token_to_id(token)

    def _mask_token_names(self) -> Iterable[str]:
        configured = self._special_names.get("mask_token")
        return ((configured,) if configured else ()) + MASK_TOKEN_NAMES

    def _encode(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: List[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _source_files(self) -> List[str]:
        return [self.tokenizer_file] + self.config_files
