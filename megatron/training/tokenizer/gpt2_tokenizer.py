"""GPT-2 byte-level BPE from ``vocab.json`` (``--vocab-file``) and ``merges.txt`` (``--merge-file``).

As in Megatron-LM, ``<|endoftext|>`` is the end-of-document id and text is encoded as plain
text: a literal "<|endoftext|>" inside a document is split into ordinary pieces, so only
preprocessing's ``--append-eod`` puts eod ids into the data.
"""

from __future__ import annotations

import json
from typing import List, Optional

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from megatron.training.tokenizer.base import MegatronTokenizer, require_file

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    """Byte-level BPE with GPT-2's pre-tokenisation (no prefix space)."""

    type_name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, add_mask_token: bool = False,
                 mask_token: Optional[int] = None) -> None:
        self.vocab_file = require_file(vocab_file, "--vocab-file", "GPT-2 vocab.json")
        self.merge_file = require_file(merge_file, "--merge-file", "GPT-2 merges.txt")
        try:
            model = BPE.from_file(self.vocab_file, self.merge_file)
        except Exception as error:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"--vocab-file {self.vocab_file} / --merge-file {self.merge_file} "
                             f"are not a readable GPT-2 BPE: {error}") from error
        self._tokenizer = Tokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        with open(self.vocab_file, encoding="utf-8") as handle:
            ids = json.load(handle).values()
        self._base_size = max(len(ids), max(ids, default=-1) + 1)
        eod = self.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"--vocab-file {self.vocab_file} has no {EOD_TOKEN} entry (the eod token)")
        self._eod = eod
        self._init_mask_token(mask_token, add_mask_token)

    @property
    def base_vocab_size(self) -> int:
        return self._base_size

    @property
    def eod(self) -> int:
        return self._eod

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tokenizer.token_to_id(token)

    def _encode(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: List[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _source_files(self) -> List[str]:
        return [self.vocab_file, self.merge_file]
