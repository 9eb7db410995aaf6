"""A SentencePiece ``.model`` file (Llama 2, Gemma, T5 style tokenizers)."""

from __future__ import annotations

from typing import List, Optional

import sentencepiece

from megatron.training.tokenizer.base import MegatronTokenizer, require_file

# Pieces taken as end-of-document when the model was trained without an eos id.
_EOD_FALLBACK_PIECES = ("</s>", "<|endoftext|>")


class SentencePieceTokenizer(MegatronTokenizer):
    """Wraps ``sentencepiece.SentencePieceProcessor``; eod is the model's eos id."""

    type_name = "SentencePieceTokenizer"

    def __init__(self, model_file: str, add_mask_token: bool = False,
                 mask_token: Optional[int] = None) -> None:
        self.model_file = require_file(model_file, "--tokenizer-model", "SentencePiece .model file")
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=self.model_file)
        except Exception as error:  # sentencepiece raises RuntimeError/OSError variants
            raise ValueError(f"--tokenizer-model {self.model_file} is not a readable "
                             f"SentencePiece model: {error}") from error
        self._eod = self._find_eod()
        self._init_mask_token(mask_token, add_mask_token)

    def _find_eod(self) -> int:
        eos = self._processor.eos_id()
        if eos >= 0:
            return eos
        found = self.first_known_id(_EOD_FALLBACK_PIECES)
        if found is not None:
            return found
        raise ValueError(f"--tokenizer-model {self.model_file} has no eos id and no piece named "
                         f"{' or '.join(_EOD_FALLBACK_PIECES)}; retrain it with an eos_id")

    @property
    def base_vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        pad = self._processor.pad_id()
        return pad if pad >= 0 else self.eod

    @property
    def bos(self) -> Optional[int]:
        bos = self._processor.bos_id()
        return bos if bos >= 0 else None

    def token_to_id(self, token: str) -> Optional[int]:
        # piece_to_id answers unk_id for unknown pieces, so confirm the round trip.
        token_id = self._processor.piece_to_id(token)
        if 0 <= token_id < self.base_vocab_size and self._processor.id_to_piece(token_id) == token:
            return token_id
        return None

    def _encode(self, text: str) -> List[int]:
        return self._processor.encode(text)

    def _decode(self, ids: List[int]) -> str:
        return self._processor.decode(ids)

    def _source_files(self) -> List[str]:
        return [self.model_file]
