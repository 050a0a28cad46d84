"""Encode and decode text with a model directory's ``tokenizer.json``, by the ``tokenizers``
library: the library SGLang 0.5.23's fast tokenizer runs (its wheel pins ``tokenizers==0.23.2``
under ``transformers==5.19.0``, whose ``TokenizersBackend`` encodes and decodes with it), so the
local engine's ids and text are the ones SGLang's would be for the same file.

``bytes_to_unicode`` is GPT-2's byte map, which the byte-level ``tokenizer.json`` that ``mixfleet
init-model`` writes spells its 256 byte tokens in (:mod:`weight_sync.base_model`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import tokenizers


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


class Tokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` for one ``tokenizer.json``, as SGLang's
    fast tokenizer does them: ``encode`` as the tokenizer manager encodes a ``text`` input (the
    fast tokenizer called on it, managers/tokenizer_manager.py 1064-1069: every added token found
    in the text becomes its id, and the file's post-processor adds its special tokens, none for
    the local model's), ``decode`` as the detokenizer's ``batch_decode``
    (managers/detokenizer_manager.py 270-300): an added token
    whose ``special`` is false (``<think>``, ``<tool_call>``) is text even with
    ``skip_special_tokens``, an id beyond the vocabulary decodes to nothing, and invalid UTF-8 to
    U+FFFD.

    ``vocab_size`` counts every id (the model's vocabulary and the added tokens).
    """

    def __init__(self, lib: tokenizers.Tokenizer) -> None:
        self._lib = lib
        self.vocab_size = lib.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of model directory ``path`` (``ValueError`` if it has no readable tokenizer.json)."""
        file = Path(path) / "tokenizer.json"
        try:
            return cls(tokenizers.Tokenizer.from_file(str(file)))
        except Exception as exc:  # the library's own (a plain Exception): a missing or unreadable file
            raise ValueError(f"{file}: no readable tokenizer ({exc})") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (class docstring)."""
        return self._lib.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens as their strings unless skipped."""
        return self._lib.decode(list(ids), skip_special_tokens=skip_special_tokens)
