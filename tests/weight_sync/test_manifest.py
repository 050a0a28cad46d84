"""Manifest: round trip, atomic write, verification naming the bad file (xxh3-128 and sha256
entries), delta shape."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import xxhash

from weight_sync.manifest import (
    MANIFEST_NAME,
    ChecksumError,
    FileEntry,
    Manifest,
    ManifestError,
    build_manifest,
    verify_dir,
)


def _dir_with_files(tmp_path):
    d = tmp_path / "v"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"hello world")
    (d / "sub" / "b.txt").write_text("bee\n")
    return d


def test_build_write_read_round_trip(tmp_path) -> None:
    d = _dir_with_files(tmp_path)
    m = build_manifest(d, format="fp8", source_checksum="xxh3_128:abc")
    assert m.files == {  # xxh3-128 is the default
        "a.bin": FileEntry(xxhash.xxh3_128(b"hello world").hexdigest(), 11, "xxh3_128"),
        "sub/b.txt": FileEntry(xxhash.xxh3_128(b"bee\n").hexdigest(), 4, "xxh3_128"),
    }
    assert m.total_bytes == 15 and m.version is None and m.kind == "full" and m.base_version is None
    m.write(d)
    assert not [p for p in d.iterdir() if p.name.startswith(".")], "temporary file left behind"
    back = Manifest.read(d)
    assert back == m
    data = json.loads((d / MANIFEST_NAME).read_text())
    assert data["schema"] == 1 and data["format"] == "fp8"
    assert data["files"]["a.bin"] == {"xxh3_128": m.files["a.bin"].digest, "bytes": 11}
    assert verify_dir(d) == m
    assert m.with_version(7).version == 7 and m.with_version(7).same_content(m)


def test_sha256_manifests_stay_verifiable(tmp_path) -> None:
    """A manifest naming sha256 (readers accept either algorithm) reads, verifies and round-trips."""
    d = _dir_with_files(tmp_path)
    m = build_manifest(d, format="fp8", algorithm="sha256")
    assert m.files["a.bin"] == FileEntry(hashlib.sha256(b"hello world").hexdigest(), 11, "sha256")
    legacy = {  # written by hand: schema 1 with sha256 entries only
        "schema": 1,
        "version": None,
        "format": "fp8",
        "kind": "full",
        "base_version": None,
        "source_checksum": "",
        "tensor_count": 0,
        "total_bytes": 15,
        "files": {
            "a.bin": {"sha256": hashlib.sha256(b"hello world").hexdigest(), "bytes": 11},
            "sub/b.txt": {"sha256": hashlib.sha256(b"bee\n").hexdigest(), "bytes": 4},
        },
    }
    (d / MANIFEST_NAME).write_text(json.dumps(legacy))
    assert verify_dir(d) == m
    assert json.loads(m.to_json())["files"] == legacy["files"]


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256", "mixed"])
def test_verify_names_the_bad_file(tmp_path, algorithm) -> None:
    d = _dir_with_files(tmp_path)
    m = build_manifest(d, format="bf16", algorithm="sha256" if algorithm == "mixed" else algorithm)
    if algorithm == "mixed":  # one entry by each algorithm
        xxh = build_manifest(d, format="bf16", algorithm="xxh3_128")
        m = dataclasses.replace(m, files={**m.files, "a.bin": xxh.files["a.bin"]})
        assert {e.algorithm for e in m.files.values()} == {"xxh3_128", "sha256"}
    m.write(d)
    assert verify_dir(d) == m
    raw = bytearray((d / "a.bin").read_bytes())
    raw[3] ^= 0x01
    (d / "a.bin").write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="a.bin") as exc:
        verify_dir(d)
    assert exc.value.path == d / "a.bin" and m.files["a.bin"].algorithm in str(exc.value)


@pytest.mark.parametrize("damage", ["missing", "truncated", "extra"])
def test_verify_structural_damage(tmp_path, damage) -> None:
    d = _dir_with_files(tmp_path)
    build_manifest(d, format="bf16").write(d)
    if damage == "missing":
        (d / "sub" / "b.txt").unlink()
        bad = d / "sub" / "b.txt"
    elif damage == "truncated":
        (d / "a.bin").write_bytes(b"hello")
        bad = d / "a.bin"
    else:
        (d / "stray.bin").write_bytes(b"x")
        bad = d / "stray.bin"
    with pytest.raises(ChecksumError) as exc:
        verify_dir(d)
    assert exc.value.path == bad
    if damage == "extra":
        verify_dir(d, allow_extra=True)


def test_malformed_and_missing_manifest(tmp_path) -> None:
    with pytest.raises(ManifestError, match="does not exist"):
        Manifest.read(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.read(tmp_path)
    for entry in (
        {"sha256": 3, "bytes": 1},  # digest not a string
        {"md5": "00", "bytes": 1},  # unknown algorithm
        {"sha256": "00", "xxh3_128": "00", "bytes": 1},  # two digests
        {"xxh3_128": "00"},  # no size
    ):
        (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": "fp8", "files": {"a": entry}}))
        with pytest.raises(ManifestError, match="malformed"):
            Manifest.read(tmp_path)


def test_delta_kind_needs_a_base() -> None:
    files = {"model-00001-of-00002.safetensors": FileEntry("0" * 32, 10, "xxh3_128")}
    delta = Manifest(7, "fp8", "delta", 6, "xxh3_128:s", files, tensor_count=3, total_bytes=10)
    assert Manifest.from_dict(json.loads(delta.to_json())) == delta
    assert not delta.same_content(Manifest(7, "fp8", "full", None, "xxh3_128:s", files, 3, 10))
    with pytest.raises(ManifestError, match="base_version"):
        Manifest(7, "fp8", "delta", None, "", files, 3, 10)
    with pytest.raises(ManifestError, match="total_bytes"):
        Manifest(7, "fp8", "full", None, "", files, 3, 11)


def test_unquantized_modules_round_trip_and_are_absent_when_none(tmp_path) -> None:
    """``unquantized`` (module -> reason) is written only when a format kept modules in BF16."""
    d = _dir_with_files(tmp_path)
    plain = build_manifest(d, format="fp8")
    assert "unquantized" not in json.loads(plain.to_json()) and plain.unquantized == {}
    reasons = {"model.layers.0.self_attn.qkv_proj": "k_proj has N=64, not a multiple of block_n=128"}
    kept = dataclasses.replace(plain, unquantized=reasons)
    kept.write(d)
    assert json.loads((d / MANIFEST_NAME).read_text())["unquantized"] == reasons
    assert Manifest.read(d) == kept and kept.with_version(3).unquantized == reasons
    for bad in ({"m": 3}, ["m"]):
        (d / MANIFEST_NAME).write_text(json.dumps({**json.loads(kept.to_json()), "unquantized": bad}))
        with pytest.raises(ManifestError, match="unquantized must map module names to reasons"):
            Manifest.read(d)
