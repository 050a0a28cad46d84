"""Encode and decode text with a model directory's ``tokenizer.json``.

Pure Python for the byte-level tokenizer ``mixfleet init-model`` writes (256 byte tokens in
GPT-2's byte-to-unicode spelling, no merges, a few special tokens): text -> UTF-8 bytes, one
token per byte, with special tokens such as ``<|eos|>`` recognised where they appear in the
text. Any other ``tokenizer.json`` is handled by the ``tokenizers`` library when it is
installed; otherwise loading it raises ``ValueError``.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any


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
    """``encode(text) -> ids`` and ``decode(ids) -> text`` for one ``tokenizer.json``.

    ``vocab_size`` counts every id (bytes and special tokens); ``special_ids`` maps special
    token strings to ids.
    """

    def __init__(self, spec: dict[str, Any], source: str = "tokenizer.json") -> None:
        self._lib = None
        model = spec.get("model") or {}
        added = spec.get("added_tokens") or []
        self.special_ids: dict[str, int] = {t["content"]: int(t["id"]) for t in added}
        pre = spec.get("pre_tokenizer") or {}
        vocab = model.get("vocab") or {}
        byte_level = (
            model.get("type") == "BPE"
            and not model.get("merges")
            and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space")
            and spec.get("normalizer") is None
            and set(bytes_to_unicode().values()) <= set(vocab)
        )
        if byte_level:
            u2b = {u: b for b, u in bytes_to_unicode().items()}
            self._byte_to_id = {u2b[tok]: int(i) for tok, i in vocab.items() if tok in u2b}
            self._id_to_bytes = {i: bytes([b]) for b, i in self._byte_to_id.items()}
            self._id_to_special = {i: s for s, i in self.special_ids.items()}
            ids = list(self._id_to_bytes) + list(self._id_to_special)
            self.vocab_size = max(ids) + 1
            specials = sorted(self.special_ids, key=len, reverse=True)
            pattern = "(" + "|".join(re.escape(s) for s in specials) + ")"
            self._split = re.compile(pattern) if specials else None
            return
        try:
            import tokenizers
        except ImportError:
            raise ValueError(
                f"{source}: not a plain byte-level tokenizer and the tokenizers library is not installed"
            ) from None
        self._lib = tokenizers.Tokenizer.from_str(json.dumps(spec))
        self.vocab_size = self._lib.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of model directory ``path`` (``ValueError`` if it has no readable tokenizer.json)."""
        file = Path(path) / "tokenizer.json"
        try:
            spec = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: no readable tokenizer ({exc})") from None
        return cls(spec, str(file))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in the text become their ids."""
        if self._lib is not None:
            return list(self._lib.encode(text, add_special_tokens=False).ids)
        pieces = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for piece in pieces:
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            else:
                ids.extend(self._byte_to_id[b] for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD); special tokens as their strings unless skipped."""
        if self._lib is not None:
            return self._lib.decode(list(ids), skip_special_tokens=skip_special_tokens)
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i in self._id_to_bytes:
                buf += self._id_to_bytes[i]
                continue
            if i not in self._id_to_special:
                raise ValueError(f"token id {i} is not in the vocabulary")
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(self._id_to_special[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)
