"""Model directories for tests: a real ``mixfleet init-model`` checkpoint, converted to a format.

``make_model_dir(root, preset, fmt)`` returns ``root/<preset>-<fmt>``, building it on first use
(BF16 base via ``mixfleet.init_model.write_model``, then ``weight_sync.convert.convert_checkpoint``
for fp8 / nvfp4 / mxfp4) and reusing it afterwards, so a session-scoped ``root`` builds each
model once. A directory appears complete or not at all (written aside, then renamed).

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
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        if fmt == "bf16":
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
