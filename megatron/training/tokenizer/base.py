"""The interface every tokenizer implements, and the mask-token resolution they share.

A masked diffusion LM needs one id that means "this position is masked". The id comes, in
order, from an explicit ``--mask-token`` override, from a mask token the vocabulary already
has (looked up by the usual names), or from a new id appended after the vocabulary when
``--add-mask-token`` is set. An appended id is never produced by ``tokenize`` (the text
tokenizer does not know it), but ``detokenize`` renders it so generated samples stay readable.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from typing import Dict, Iterable, List, Optional, Sequence

# Names under which vocabularies commonly carry a mask token, most specific first.
MASK_TOKEN_NAMES = ("<|mask|>", "<|mdm_mask|>", "<|mask_token|>", "<mask>", "[MASK]", "<M>")
# The string an appended mask id renders as.
ADDED_MASK_TOKEN = "<|mask|>"


def require_file(path: Optional[str], flag: str, what: str) -> str:
    """Return ``path`` if it names an existing file, else raise naming the flag and the path."""
    if not path:
        raise ValueError(f"{flag} is required: the path of the {what}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file (expected the {what})")
    return path


def sha256_of_files(paths: Sequence[str]) -> Optional[str]:
    """Hex sha256 of the file content; for several files, of their names and content hashes.

    One file hashes to exactly what ``sha256sum`` prints, so it can be checked by hand.
    """
    if not paths:
        return None
    digests = []
    for path in paths:
        with open(path, "rb") as handle:
            digests.append(hashlib.sha256(handle.read()).hexdigest())
    if len(paths) == 1:
        return digests[0]
    combined = hashlib.sha256()
    for path, digest in zip(paths, digests):
        combined.update(f"{os.path.basename(path)}\0{digest}\n".encode())
    return combined.hexdigest()


class MegatronTokenizer(ABC):
    """Text <-> ids, plus the special ids training needs (eod, pad, bos, mask).

    Subclasses load their files, then call :meth:`_init_mask_token`; they implement the
    ``_encode``/``_decode`` pair over the base vocabulary and ``token_to_id`` for lookups.
    """

    type_name: str = "MegatronTokenizer"

    _mask: Optional[int] = None
    _mask_is_added: bool = False

    # ----- what subclasses provide ---------------------------------------------------------
    @property
    @abstractmethod
    def base_vocab_size(self) -> int:
        """Number of ids the underlying tokenizer defines (without an appended mask token)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended after each document by preprocessing."""

    @abstractmethod
    def token_to_id(self, token: str) -> Optional[int]:
        """The id of a whole vocabulary entry, or None when the vocabulary has no such entry."""

    def first_known_id(self, names) -> Optional[int]:
        """The id of the first of `names` the vocabulary holds (special-token discovery)."""
        for name in names:
            found = self.token_to_id(name)
            if found is not None:
                return found
        return None

    @abstractmethod
    def _encode(self, text: str) -> List[int]:
        """Ids of ``text`` without any special tokens added."""

    @abstractmethod
    def _decode(self, ids: List[int]) -> str:
        """Text of ids that all lie in the base vocabulary."""

    def _source_files(self) -> List[str]:
        """The files whose content defines this tokenizer (hashed into :attr:`identity`)."""
        return []

    def _mask_token_names(self) -> Iterable[str]:
        """Names tried, in order, when looking for a mask token in the vocabulary."""
        return MASK_TOKEN_NAMES

    # ----- the shared interface ------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids the model must embed: the base vocabulary plus an appended mask token."""
        return self.base_vocab_size + (1 if self._mask_is_added else 0)

    @property
    def pad(self) -> int:
        return self.eod

    @property
    def bos(self) -> Optional[int]:
        return None

    @property
    def mask(self) -> Optional[int]:
        """The diffusion mask token id, or None when there is none."""
        return self._mask

    @property
    def mask_is_added(self) -> bool:
        """True when the mask id was appended after the base vocabulary."""
        return self._mask_is_added

    def tokenize(self, text: str) -> List[int]:
        return [int(i) for i in self._encode(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if not self._mask_is_added or self._mask not in ids:
            return self._decode(ids)
        pieces, segment = [], []
        for token_id in ids:
            if token_id == self._mask:
                if segment:
                    pieces.append(self._decode(segment))
                    segment = []
                pieces.append(ADDED_MASK_TOKEN)
            else:
                segment.append(token_id)
        if segment:
            pieces.append(self._decode(segment))
        return "".join(pieces)

    @property
    def identity(self) -> Dict[str, object]:
        """A small JSON-able record for checkpoint metadata, to catch a tokenizer mix-up.

        ``sha256`` is what compatibility checks compare (the same bytes anywhere are the same
        tokenizer). ``files``, the absolute paths the tokenizer was loaded from, only says where
        it came from, so exporters and generation scripts can find it again without flags; it is
        absent for tokenizers without files (NullTokenizer).
        """
        files = self._source_files()
        identity: Dict[str, object] = {
            "type": self.type_name,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "mask": self.mask,
            "sha256": sha256_of_files(files),
        }
        if files:
            identity["files"] = [os.path.abspath(path) for path in files]
        return identity

    # ----- mask resolution -----------------------------------------------------------------
    def _init_mask_token(self, mask_token: Optional[int] = None, add_mask_token: bool = False) -> None:
        """Resolve the mask id: override, then a named vocabulary entry, then an appended id."""
        base = self.base_vocab_size
        self._mask, self._mask_is_added = None, False
        if mask_token is not None:
            mask_token = int(mask_token)
            # With --add-mask-token the appended id (== base size) is a valid explicit choice.
            limit = base + 1 if add_mask_token else base
            if not 0 <= mask_token < limit:
                raise ValueError(
                    f"--mask-token {mask_token} is outside the tokenizer vocabulary of size {base}"
                    f"{' (+1 appended mask token)' if add_mask_token else ''}; pass an id in "
                    f"[0, {limit}) or drop --mask-token")
            self._mask, self._mask_is_added = mask_token, mask_token == base
            return
        found = self.first_known_id(self._mask_token_names())
        if found is not None:
            self._mask = found
            return
        if add_mask_token:
            self._mask, self._mask_is_added = base, True

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, "
                f"pad={self.pad}, bos={self.bos}, mask={self.mask})")
