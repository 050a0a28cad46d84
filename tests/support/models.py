"""Model directories for tests: a real ``mixfleet init-model`` checkpoint, converted to a format.

``make_model_dir(root, preset, fmt)`` returns ``root/<preset>-<fmt>``, building it on first use
(BF16 base via ``mixfleet.init_model.write_model``, then ``weight_sync.convert.convert_checkpoint``
for fp8 / nvfp4 / mxfp4) and reusing it afterwards, so a session-scoped ``root`` builds each
model once. With ``MIXFLEET_TEST_MODEL_CACHE`` set (the suite sets it), each model is built once
there and copied to the other roots. A directory appears complete or not at all (written aside,
then renamed).

Typical use::

    @pytest.fixture(scope="session")
    def model_root(tmp_path_factory):
        return tmp_path_factory.mktemp("models")

    def test_x(model_root):
        path = make_model_dir(model_root, "tiny", "fp8")
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from core.formats import FORMATS

# A directory (set by tests/conftest.py for the session) where each model is built once; a model
# asked for under another root is copied from there (models are deterministic in their preset, format
# and seed; a copy, so a test that alters its files alters only its own).
CACHE_ENV = "MIXFLEET_TEST_MODEL_CACHE"


def make_model_dir(
    tmp_root: str | Path, preset: str = "tiny", fmt: str = "bf16", seed: int | None = None
) -> Path:
    """The ``preset`` base policy (seed ``seed`` or the default) in format ``fmt``, under ``tmp_root``.

    Before: ``tmp_root`` is a writable directory. After: the returned directory is a complete
    checkpoint a ``load_model`` / ``mixfleet engine --model`` accepts.
    """
    from mixfleet.init_model import DEFAULT_SEED, write_model

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    root = Path(tmp_root)
    seed = DEFAULT_SEED if seed is None else seed
    suffix = "" if seed == DEFAULT_SEED else f"-s{seed}"
    final = root / f"{preset}-{fmt}{suffix}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    cache = os.environ.get(CACHE_ENV)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        if cache and Path(cache).resolve() != root.resolve():
            shutil.rmtree(staging)  # a copy of the one this session built, byte for byte the same
            shutil.copytree(make_model_dir(cache, preset, fmt, seed), staging)
        elif fmt == "bf16":
            write_model(staging, preset, seed)
        else:
            base = make_model_dir(root, preset, "bf16", seed)
            shutil.rmtree(staging)
            from weight_sync.convert import convert_checkpoint

            convert_checkpoint(base, staging, fmt)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
