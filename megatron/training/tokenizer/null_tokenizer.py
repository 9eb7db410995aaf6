"""A tokenizer without text: ids are tokens. Used with pre-tokenized or synthetic data."""

from __future__ import annotations

from typing import List, Optional


class NullTokenizer:
    """Ids 0 .. vocab_size-2 are tokens and vocab_size-1 is EOD; with add_mask_token one more
    id (vocab_size) is the mask token. There is no mask token otherwise."""

    def __init__(self, vocab_size: int, add_mask_token: bool = False) -> None:
        if vocab_size < 2:
            raise ValueError(f"--vocab-size {vocab_size} must be >= 2 (the last id is EOD)")
        self._base_size = vocab_size
        self.mask: Optional[int] = vocab_size if add_mask_token else None

    @property
    def vocab_size(self) -> int:
        return self._base_size + (1 if self.mask is not None else 0)

    @property
    def eod(self) -> int:
        return self._base_size - 1

    @property
    def pad(self) -> int:
        return self.eod

    @property
    def bos(self) -> Optional[int]:
        return None

    def tokenize(self, text: str) -> List[int]:
        return [int(token) for token in text.split()]

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(i) for i in ids)
