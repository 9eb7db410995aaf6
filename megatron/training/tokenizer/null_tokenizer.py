"""A tokenizer without text: ids are tokens. Used with pre-tokenized or synthetic data."""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron.training.tokenizer.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Ids 0 .. vocab_size-1, of which vocab_size-1 is EOD unless `eod_id` names another
    (`--null-tokenizer-eod-id`); with add_mask_token one more id (vocab_size) is the mask token.
    There is no mask token otherwise (no names to look up). The ids are megatron-core's since 0.18
    (`--vocab-size N`: vocabulary N, EOD N-1); up to 0.17 Megatron read N as N tokens and EOD N,
    which is `--vocab-size N+1` here.

    Text is whitespace-separated decimal ids both ways; a mask id prints as its number too, so
    ``tokenize(detokenize(ids)) == ids`` always holds.
    """

    type_name = "NullTokenizer"

    def __init__(self, vocab_size: int, add_mask_token: bool = False,
                 mask_token: Optional[int] = None, eod_id: Optional[int] = None) -> None:
        if vocab_size is None or vocab_size < 2:
            raise ValueError(f"--vocab-size {vocab_size} must be >= 2 (the last id is EOD)")
        self._base_size = int(vocab_size)
        self._eod = self._base_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self._eod < self._base_size:
            raise ValueError(f"--null-tokenizer-eod-id {eod_id} is outside the vocabulary of --vocab-size "
                             f"{vocab_size}; pass an id in [0, {vocab_size}) or drop it (EOD {vocab_size - 1})")
        self._init_mask_token(mask_token, add_mask_token)

    @property
    def base_vocab_size(self) -> int:
        return self._base_size

    @property
    def eod(self) -> int:
        return self._eod

    def token_to_id(self, token: str) -> Optional[int]:
        return None

    def _encode(self, text: str) -> List[int]:
        return [int(token) for token in text.split()]

    def _decode(self, ids: List[int]) -> str:
        return " ".join(str(i) for i in ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])
