"""The manifest of a weight directory: what files it holds, their sizes and digests, and what it is.

``manifest.json`` sits beside the files it describes (a converted checkpoint, a store version):

```
{"schema": 1, "version": 7 | null, "format": "fp8", "kind": "full" | "delta",
 "base_version": null | 6, "source_checksum": "xxh3_128:...", "tensor_count": 1234,
 "total_bytes": 123456, "files": {"config.json": {"xxh3_128": "...", "bytes": 812}, ...}}
```

- ``files`` lists every file of the directory except ``manifest.json`` itself, by POSIX relative
  path, with its size and its digest under the name of the algorithm that made it (one of
  ``checksum.ALGORITHMS``: ``xxh3_128``, what new manifests use, or ``sha256``; readers accept
  either, file by file); ``total_bytes`` is the sum of their sizes; ``tensor_count`` counts the
  tensors in the directory's ``*.safetensors`` files.
- ``kind == "full"``: the directory alone is the checkpoint (``base_version`` is None).
  ``kind == "delta"``: the directory holds only the files whose tensors changed relative to
  ``base_version`` (same relative paths, same format); every file it does not list comes from the
  base. ``tensor_count``/``total_bytes`` then describe the delta's own files.
- ``version`` is None until a store commits the directory as a numbered version.
- ``unquantized`` (present only when not empty): the modules a quantized format keeps in BF16
  although it would quantize them, each with the reason (fp8: the merged linears and fused-MoE
  layers SGLang's block-FP8 loader refuses, see ``formats.fp8_layout``); the checkpoint's
  ``quantization_config`` lists them for SGLang.

``verify_dir`` checks a directory against its manifest (each file with the algorithm its entry
names) and raises ``ChecksumError`` naming the first file that is missing, has the wrong size or
the wrong digest, or is not listed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.errors import UserError
from weight_sync.checksum import ALGORITHMS, DEFAULT_ALGORITHM, file_digest
from weight_sync.safetensors_io import SafetensorsError, read_header

MANIFEST_NAME = "manifest.json"
SCHEMA = 1
KINDS = ("full", "delta")


class ChecksumError(UserError):
    """A directory does not match its manifest; ``path`` names the offending file."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class ManifestError(UserError):
    """A ``manifest.json`` is missing or malformed."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a manifest: its hex ``digest`` by ``algorithm`` (see ``checksum.ALGORITHMS``)
    and its size in bytes. Entries with other algorithms are different entries, even for the
    same bytes (comparing them would need the file)."""

    digest: str
    bytes: int
    algorithm: str

    def to_dict(self) -> dict[str, Any]:
        return {self.algorithm: self.digest, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, rel: str, e: object) -> FileEntry:
        """Parse ``{"<algorithm>": hex, "bytes": n}``; ``ManifestError`` unless exactly one known
        algorithm names a string digest and ``bytes`` is an integer."""
        algos = [a for a in ALGORITHMS if isinstance(e, dict) and a in e]
        if len(algos) != 1 or not isinstance(e[algos[0]], str) or not _is_int(e.get("bytes")):
            raise ManifestError(
                f"manifest entry for {rel!r} is malformed "
                f"(needs bytes and one digest of {', '.join(ALGORITHMS)})"
            )
        return cls(digest=e[algos[0]], bytes=int(e["bytes"]), algorithm=algos[0])


@dataclass(frozen=True)
class Manifest:
    """What a weight directory holds. Immutable; ``with_version`` makes a renumbered copy."""

    version: int | None
    format: str
    kind: str
    base_version: int | None
    source_checksum: str
    files: dict[str, FileEntry] = field(default_factory=dict)
    tensor_count: int = 0
    total_bytes: int = 0
    unquantized: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ManifestError(f"manifest kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "delta" and self.base_version is None:
            raise ManifestError("a delta manifest needs base_version")
        if self.kind == "full" and self.base_version is not None:
            raise ManifestError("a full manifest has no base_version")
        if self.total_bytes != sum(e.bytes for e in self.files.values()):
            raise ManifestError("manifest total_bytes is not the sum of its files' sizes")
        if MANIFEST_NAME in self.files:
            raise ManifestError(f"a manifest does not list {MANIFEST_NAME} itself")

    # --- (de)serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": self.version,
            "format": self.format,
            "kind": self.kind,
            "base_version": self.base_version,
            "source_checksum": self.source_checksum,
            "tensor_count": self.tensor_count,
            "total_bytes": self.total_bytes,
            "files": {k: v.to_dict() for k, v in sorted(self.files.items())},
        } | ({"unquantized": dict(sorted(self.unquantized.items()))} if self.unquantized else {})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        """Parse a manifest dict; raises ``ManifestError`` naming the bad field."""
        try:
            if d.get("schema", SCHEMA) != SCHEMA:
                raise ManifestError(f"unsupported manifest schema {d.get('schema')!r}")
            files = {str(rel): FileEntry.from_dict(str(rel), e) for rel, e in d["files"].items()}
            version = d.get("version")
            base = d.get("base_version")
            for key, val in (("version", version), ("base_version", base)):
                if val is not None and not _is_int(val):
                    raise ManifestError(f"manifest {key} must be an integer or null, got {val!r}")
            return cls(
                version=version,
                format=str(d["format"]),
                kind=str(d.get("kind", "full")),
                base_version=base,
                source_checksum=str(d.get("source_checksum", "")),
                files=files,
                tensor_count=int(d.get("tensor_count", 0)),
                total_bytes=int(d.get("total_bytes", sum(e.bytes for e in files.values()))),
                unquantized=_unquantized(d.get("unquantized", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from exc

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """The manifest of ``directory``; raises ``ManifestError`` if missing or malformed."""
        path = Path(directory) / MANIFEST_NAME
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ManifestError(f"{path} does not exist") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{path} is not a JSON object")
        try:
            return cls.from_dict(data)
        except ManifestError as exc:
            raise ManifestError(f"{path}: {exc}") from None

    def write(self, directory: Path, *, fsync: bool = True) -> Path:
        """Atomically (tmp file + ``os.replace``) write ``directory/manifest.json``.

        After: the file holds this manifest; with ``fsync`` it and the directory entry are
        durable. A reader never sees a partial manifest.
        """
        directory = Path(directory)
        path = directory / MANIFEST_NAME
        tmp = directory / f".{MANIFEST_NAME}.tmp.{os.getpid()}"
        data = self.to_json().encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if fsync:
            fsync_dir(directory)
        return path

    def with_version(self, version: int | None) -> Manifest:
        return replace(self, version=version)

    def same_content(self, other: Manifest) -> bool:
        """True when both describe the same bytes in the same format and kind (version aside)."""
        return (
            self.format == other.format
            and self.kind == other.kind
            and self.base_version == other.base_version
            and self.files == other.files
        )


def _unquantized(v: object) -> dict[str, str]:
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(r, str) for k, r in v.items()):
        raise ManifestError(f"manifest unquantized must map module names to reasons, got {v!r}")
    return dict(v)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so entries created, renamed or removed in it are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_files(directory: Path) -> list[str]:
    """POSIX relative paths of the regular files under ``directory`` except the manifest and
    hidden temporaries (names starting with '.'), sorted."""
    directory = Path(directory)
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.startswith("."):
                continue
            rel = Path(root, name).relative_to(directory).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def count_tensors(path: Path) -> int:
    """Number of tensors in a safetensors file (reads only its header); ``ChecksumError`` naming
    the file when it is not a well-formed safetensors file."""
    try:
        return len(read_header(path)[0])
    except SafetensorsError as exc:
        raise ChecksumError(path, str(exc).removeprefix(f"{path}: ")) from None


def build_manifest(
    directory: Path,
    *,
    format: str,
    source_checksum: str = "",
    kind: str = "full",
    base_version: int | None = None,
    version: int | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
) -> Manifest:
    """Describe the files now in ``directory`` (hashing each with ``algorithm``). Writes nothing."""
    directory = Path(directory)
    files = {}
    tensors = 0
    for rel in list_files(directory):
        p = directory / rel
        files[rel] = FileEntry(digest=file_digest(p, algorithm), bytes=p.stat().st_size, algorithm=algorithm)
        if rel.endswith(".safetensors"):
            tensors += count_tensors(p)
    return Manifest(
        version=version,
        format=format,
        kind=kind,
        base_version=base_version,
        source_checksum=source_checksum,
        files=files,
        tensor_count=tensors,
        total_bytes=sum(e.bytes for e in files.values()),
    )


def check_file_set(directory: Path, manifest: Manifest, *, allow_extra: bool = False) -> None:
    """Cheap structural check: every listed file exists with its size; nothing unlisted.

    Raises ``ChecksumError`` naming the first offending file. Does not hash.
    """
    directory = Path(directory)
    for rel, entry in sorted(manifest.files.items()):
        p = directory / rel
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise ChecksumError(p, "missing (listed in the manifest)") from None
        if size != entry.bytes:
            raise ChecksumError(p, f"size {size} != manifest's {entry.bytes}")
    if not allow_extra:
        for rel in list_files(directory):
            if rel not in manifest.files:
                raise ChecksumError(directory / rel, "not listed in the manifest")


def verify_dir(directory: Path, *, allow_extra: bool = False) -> Manifest:
    """Check every file of ``directory`` against its manifest; return the manifest.

    Raises ``ChecksumError`` naming the file when one is missing, has another size or digest
    than recorded (each file is hashed with the algorithm its entry names), or (unless
    ``allow_extra``) is not listed; ``ManifestError`` when the manifest itself is missing or
    malformed.
    """
    directory = Path(directory)
    manifest = Manifest.read(directory)
    check_file_set(directory, manifest, allow_extra=allow_extra)
    for rel, entry in sorted(manifest.files.items()):
        p = directory / rel
        try:
            digest = file_digest(p, entry.algorithm)
        except FileNotFoundError:
            raise ChecksumError(p, "missing (listed in the manifest)") from None
        check_digest(p, digest, entry)
    return manifest


def check_digest(path: Path, digest: str, entry: FileEntry) -> None:
    """``ChecksumError`` naming ``path`` unless ``digest`` (by ``entry.algorithm``) is the entry's."""
    if digest != entry.digest:
        raise ChecksumError(
            path, f"{entry.algorithm} {digest[:16]}... != manifest's {entry.digest[:16]}... (content differs)"
        )
