"""Publishing: once per format, barrier vs per-format pointer moves, rollback, immutability, and a
real publisher process killed mid-conversion (no pointer moves; the next publish succeeds)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.errors import UserError
from tests.support.procs import REPO, mixfleet_argv
from weight_sync.convert import convert_checkpoint
from weight_sync.layout import LayoutMismatch
from weight_sync.publish import ConversionPool, bootstrap, publish_checkpoint, rollback
from weight_sync.store.local import LocalStore
from weight_sync.types import FormatRef, VersionRef

FORMATS = ["bf16", "fp8", "nvfp4"]
RUN = "r"


def _events(store: LocalStore, version: int, ckpt: Path, mode: str) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    publish_checkpoint(
        store,
        RUN,
        version,
        ckpt,
        FORMATS,
        mode=mode,
        workers=0,
        on_event=lambda kind, info: seen.append((kind, info["format"])),
    )
    return seen


def test_barrier_moves_no_pointer_before_every_format_is_committed(tmp_path, tiny_base) -> None:
    store = LocalStore(tmp_path / "store")
    seen = _events(store, 1, tiny_base, "barrier")
    kinds = [k for k, _ in seen]
    assert kinds.count("converted") == 3 and kinds.count("committed") == 3 and kinds.count("advanced") == 3
    first_advance = kinds.index("advanced")
    assert all(k != "committed" for k in kinds[first_advance:]), seen
    for f in FORMATS:
        assert store.read_pointer(FormatRef(RUN, f)) == 1
        m = store.verify(VersionRef(RUN, f, 1))
        assert m.version == 1 and m.format == f and m.kind == "full"


def test_per_format_moves_each_pointer_as_soon_as_its_format_is_ready(tmp_path, tiny_base) -> None:
    store = LocalStore(tmp_path / "store")
    seen = _events(store, 1, tiny_base, "per_format")
    kinds = [k for k, _ in seen]
    # The first format's pointer moves while another format is still to be converted.
    assert kinds.index("advanced") < max(i for i, k in enumerate(kinds) if k == "converted"), seen
    assert {store.read_pointer(FormatRef(RUN, f)) for f in FORMATS} == {1}


def test_warm_pool_converts_in_every_worker_and_cleans_up(tmp_path, tiny_base, monkeypatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the spawned workers' temp dir
    pool = ConversionPool(workers=2)
    try:
        workers = pool.warm()
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, 0)  # alive
        assert not list(scratch.iterdir())  # the warm-up conversions were removed
        store = LocalStore(tmp_path / "store")
        result = publish_checkpoint(store, RUN, 1, tiny_base, FORMATS, conversion_pool=pool)
        assert sorted(f.format for f in result.formats) == sorted(FORMATS)
        for f in FORMATS:
            assert store.verify(VersionRef(RUN, f, 1)).version == 1
    finally:
        pool.close()


def test_a_pool_whose_idle_workers_were_killed_is_replaced(tmp_path, tiny_base) -> None:
    """The OOM killer or an operator killed the kept pool's workers between publications: the next
    publication starts new workers instead of failing on the broken pool, also when the executor
    has not yet noticed the deaths (its manager thread marks the pool broken later: the pool is
    replaced by what it sees of its workers, not by that mark)."""
    pool = ConversionPool(workers=2)
    try:
        killed = pool.warm()
        old = pool.executor()
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        # a killed worker's threads (torch's) take a while to exit: until then it is not reapable
        # and the pool cannot tell it from a live one
        deadline = time.monotonic() + 30
        while pool.executor() is old:
            assert time.monotonic() < deadline, f"the pool of the killed workers {killed} was kept"
            time.sleep(0.05)
        store = LocalStore(tmp_path / "store")
        result = publish_checkpoint(store, RUN, 1, tiny_base, FORMATS, conversion_pool=pool)
        assert sorted(f.format for f in result.formats) == sorted(FORMATS)
        assert not killed & pool.warm()
    finally:
        pool.close()


def test_a_pool_whose_dead_worker_another_thread_reaped_is_replaced() -> None:
    """The executor's manager thread may reap a killed worker before the pool looks at it; from
    then on ``multiprocessing`` lists it as a running child (its ``waitpid`` fails). Reaping it
    here does what that thread does, every time: the pool is replaced all the same."""
    pool = ConversionPool(workers=1)
    try:
        (pid,) = pool.warm()
        old = pool.executor()
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # the manager thread may have reaped it first
            os.waitpid(pid, 0)
        assert pool.executor() is not old
        assert pid not in pool.warm()
    finally:
        pool.close()


def test_converted_once_per_format_and_republish_is_idempotent(tmp_path, tiny_base, tiny_seed2) -> None:
    store = LocalStore(tmp_path / "store")
    first = publish_checkpoint(store, RUN, 1, tiny_base, FORMATS + ["bf16"], workers=0)
    assert sorted(f.format for f in first.formats) == sorted(FORMATS)  # duplicates collapse
    again = publish_checkpoint(store, RUN, 1, tiny_base, FORMATS, workers=0)
    assert all(f.reused for f in again.formats)
    with pytest.raises(UserError, match="already committed .* from another checkpoint"):
        publish_checkpoint(store, RUN, 1, tiny_seed2, FORMATS, workers=0)
    publish_checkpoint(store, RUN, 3, tiny_seed2, FORMATS, workers=0)
    with pytest.raises(UserError, match="older than .* current"):
        publish_checkpoint(store, RUN, 2, tiny_seed2, FORMATS, workers=0)
    with pytest.raises(UserError, match="does not exist"):
        publish_checkpoint(store, RUN, 4, tmp_path / "missing", FORMATS, workers=0)
    with pytest.raises(UserError, match="unknown weight format"):
        publish_checkpoint(store, RUN, 4, tiny_base, ["int3"], workers=0)


def test_a_checkpoint_of_another_layout_is_refused_before_anything_moves(
    tmp_path, tiny_base, tiny_2shards, tiny_other_arch
) -> None:
    """An engine loads a version into the model it serves (SGLang skips unknown tensors, keeps
    missing ones and dies on another shape: weight_sync/layout.py), so a version must hold the
    current version's tensors exactly; the file split and a delta's layers do not matter."""
    from mixfleet.init_model import PRESETS, write_model

    store = LocalStore(tmp_path / "store")
    publish_checkpoint(store, RUN, 1, tiny_base, FORMATS, workers=0)
    publish_checkpoint(store, RUN, 2, tiny_2shards, FORMATS, workers=0)
    publish_checkpoint(store, RUN, 3, tiny_2shards, FORMATS, workers=0, delta_of=2)  # no file of its own
    assert store.read_manifest(VersionRef(RUN, "fp8", 3)).kind == "delta"
    assert not list(store.version_dir(VersionRef(RUN, "fp8", 3)).glob("*.safetensors"))
    tiny = PRESETS["tiny"]
    h, m = tiny.hidden_size, tiny.moe_intermediate_size
    wider = write_model(
        tmp_path / "wider", dataclasses.replace(tiny, moe_intermediate_size=2 * tiny.moe_intermediate_size)
    )
    for ckpt, difference in (
        (tiny_other_arch, f"tensor 'model.layers.{tiny.num_hidden_layers - 1}."),
        (
            wider,
            f"tensor 'model.layers.0.mlp.experts.0.down_proj.weight' is BF16 [{h}, {2 * m}], "
            f"the current version's BF16 [{h}, {m}]",
        ),
    ):
        with pytest.raises(LayoutMismatch) as refused:
            publish_checkpoint(store, RUN, 4, ckpt, FORMATS, workers=0)
        assert (refused.value.format, refused.value.version) == ("bf16", 3), refused.value
        assert refused.value.difference.startswith(difference), refused.value.difference
        assert f"checkpoint {ckpt} does not fit run 'r': in bf16, {difference}" in str(refused.value)
        for f in FORMATS:
            assert store.read_pointer(FormatRef(RUN, f)) == 3 and 4 not in store.versions(FormatRef(RUN, f))
    assert "of the current version is missing" in str(
        pytest.raises(
            LayoutMismatch, publish_checkpoint, store, RUN, 4, tiny_other_arch, ["nvfp4"], workers=0
        ).value
    )


def test_the_layout_check_imports_no_torch(tmp_path, tiny_base) -> None:
    """A publish over a committed version checks the checkpoint's layout in the process that
    publishes (a router worker) from the tensors' headers alone: planning the conversion of every
    format imports no torch (the quantizers are imported where a conversion runs: torch would
    stay resident in the router process)."""
    store = LocalStore(tmp_path / "store")
    publish_checkpoint(store, RUN, 1, tiny_base, FORMATS, workers=0)
    store_root, ckpt = str(tmp_path / "store"), str(tiny_base)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from weight_sync.layout import check_layout\n"
        "from weight_sync.store.local import LocalStore\n"
        f"check_layout(LocalStore(Path({store_root!r})), {RUN!r}, Path({ckpt!r}), {FORMATS!r})\n"
        "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))\n"
    )
    argv = [sys.executable, "-c", script]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_checkpoint_already_on_the_store_filesystem(tmp_path, tiny_base) -> None:
    """A trainer that wrote its checkpoint onto the store's volume hands over that path."""
    root = tmp_path / "store"
    uploaded = root / "uploads" / "step-100"
    shutil.copytree(tiny_base, uploaded)
    store = LocalStore(root)
    result = publish_checkpoint(store, RUN, 1, uploaded, FORMATS, workers=0)
    assert {f.format for f in result.formats} == set(FORMATS)
    for f in FORMATS:
        assert store.read_pointer(FormatRef(RUN, f)) == 1 and store.versions(FormatRef(RUN, f)) == [1]
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(p.name for p in tiny_base.iterdir())


def test_bootstrap_starts_a_run_at_version_0_and_fills_in_new_formats(
    tmp_path, tiny_base, tiny_seed2
) -> None:
    store = LocalStore(tmp_path / "store")
    assert bootstrap(store, RUN, tiny_base, ["bf16", "fp8"], workers=0) == {"bf16": 0, "fp8": 0}
    assert bootstrap(store, RUN, tiny_base, ["bf16", "fp8"], workers=0) == {"bf16": 0, "fp8": 0}
    publish_checkpoint(store, RUN, 3, tiny_seed2, ["bf16", "fp8"], workers=0)
    # A group of a new format joins a run at version 3: it gets version 3's content.
    assert bootstrap(store, RUN, tiny_base, FORMATS, workers=0) == {"bf16": 3, "fp8": 3, "nvfp4": 3}
    store.verify(VersionRef(RUN, "nvfp4", 3))
    assert store.versions(FormatRef(RUN, "nvfp4")) == [3]
    direct = tmp_path / "direct-nvfp4"
    convert_checkpoint(tiny_seed2, direct, "nvfp4", workers=1)
    for shard in direct.glob("*.safetensors"):
        assert (
            store.version_dir(VersionRef(RUN, "nvfp4", 3)) / shard.name
        ).read_bytes() == shard.read_bytes()


def test_rollback_publishes_a_new_number_with_old_content(tmp_path, tiny_base, tiny_seed2) -> None:
    store = LocalStore(tmp_path / "store")
    publish_checkpoint(store, RUN, 1, tiny_base, FORMATS, workers=0)
    publish_checkpoint(store, RUN, 2, tiny_seed2, FORMATS, workers=0)
    result = rollback(store, RUN, 1, FORMATS)
    assert result.version == 3 and result.content_of == 1
    for f in FORMATS:
        assert store.read_pointer(FormatRef(RUN, f)) == 3
        m3, m1, m2 = (store.verify(VersionRef(RUN, f, v)) for v in (3, 1, 2))
        assert m3.version == 3 and m3.same_content(m1) and not m3.same_content(m2)
        for rel in m1.files:
            a = (store.version_dir(VersionRef(RUN, f, 1)) / rel).read_bytes()
            assert a == (store.version_dir(VersionRef(RUN, f, 3)) / rel).read_bytes()
    with pytest.raises(UserError, match="no bf16 version 9"):
        rollback(store, RUN, 9, FORMATS)


def _publisher(store_root: Path, ckpt: Path, version: int, workers: int) -> subprocess.Popen:
    argv = mixfleet_argv(
        "weights",
        "publish",
        "--store",
        str(store_root),
        "--run",
        RUN,
        "--version",
        str(version),
        "--formats",
        ",".join(FORMATS),
        "--workers",
        str(workers),
        str(ckpt),
    )
    return subprocess.Popen(
        argv,
        cwd=REPO,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _kill_after(proc: subprocess.Popen, marker: str, timeout: float = 120.0) -> list[str]:
    lines = []
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line.rstrip())
        if marker in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        assert time.monotonic() < deadline, lines
    proc.wait(timeout=30)
    return lines


def test_publisher_killed_mid_conversion(tmp_path, tiny_base) -> None:
    """SIGKILL the publisher (and its conversion workers) while formats are still converting:
    no pointer moves (at ``committed`` one format is already durable); publishing N again
    succeeds and keeps the already-committed format."""
    root = tmp_path / "store"
    store = LocalStore(root)
    publish_checkpoint(store, RUN, 1, tiny_base, FORMATS, workers=0)
    proc = _publisher(root, tiny_base, 2, workers=1)  # one worker: formats convert one after another
    lines = _kill_after(proc, "committed")
    assert proc.returncode == -signal.SIGKILL, lines
    assert not any("advanced" in x for x in lines), lines
    committed = [f for f in FORMATS if 2 in store.versions(FormatRef(RUN, f))]
    assert 1 <= len(committed) < len(FORMATS), (committed, lines)  # killed between two conversions
    for f in FORMATS:
        assert store.read_pointer(FormatRef(RUN, f)) == 1
        store.verify(VersionRef(RUN, f, 1))

    left = [p for f in FORMATS for p in (root / RUN / f / ".staging").iterdir()]
    assert left, "the killed publisher left its staging"
    for p in left:  # an hour later, the next publish removes them (clean_staging)
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    result = publish_checkpoint(store, RUN, 2, tiny_base, FORMATS, workers=0)
    assert sorted(f.format for f in result.formats if f.reused) == sorted(committed)
    for f in FORMATS:
        assert store.read_pointer(FormatRef(RUN, f)) == 2
        store.verify(VersionRef(RUN, f, 2))
        assert list((root / RUN / f / ".staging").iterdir()) == []


def test_a_failed_conversion_leaves_no_staging(tmp_path, tiny_base) -> None:
    """A shard whose data is cut short passes the header checks and fails its conversions: one
    error naming it, no pointer, and no staged directory left (they stayed, partial, each a
    checkpoint's size)."""
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_base, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1000])
    store = LocalStore(tmp_path / "store")
    with pytest.raises(UserError, match="corrupt safetensors file"):
        publish_checkpoint(store, RUN, 1, bad, FORMATS, workers=0)
    for f in FORMATS:
        assert store.read_pointer(FormatRef(RUN, f)) is None
        assert list((tmp_path / "store" / RUN / f / ".staging").iterdir()) == []


def test_cli_bad_input_is_one_line(tmp_path) -> None:
    r = subprocess.run(
        mixfleet_argv(
            "weights", "publish", "--store", str(tmp_path / "s"), "--version", "1", str(tmp_path / "nope")
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "does not exist" in r.stderr, r.stderr
    (tmp_path / "a-file").write_text("x")
    for store in (tmp_path / "a-file", tmp_path / "a-file" / "below"):  # was a traceback
        r = subprocess.run(
            mixfleet_argv("weights", "publish", "--store", str(store), str(tmp_path / "nope")),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"store {store}: not a directory" in r.stderr, r.stderr
    r = subprocess.run(
        mixfleet_argv("weights", "status", "--router", "http://127.0.0.1:9"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "cannot reach the router" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_router_pool_has_a_worker_per_format_even_on_fewer_cores(tmp_path) -> None:
    from router.config import WeightsConfig
    from router.publishing import PublishService
    from weight_sync.converters import LocalConverter

    def converter(**kw) -> LocalConverter:
        c = PublishService(WeightsConfig(store_root=tmp_path / "store", run_id=RUN, **kw)).converter
        assert isinstance(c, LocalConverter)  # no MIXFLEET_CONVERT_FUNCTION: the router's own pool
        return c

    cores = os.cpu_count() or 1
    local = converter()
    pool = local.start_pool(cores + 1, warm=False)
    assert pool is not None and pool.workers == cores + 1 and pool.threads == 1
    assert local.start_pool(1, warm=False) is pool  # one pool for the router's life
    assert converter().start_pool(1, warm=False).workers == cores
    assert converter(workers=1).start_pool(9, warm=False).workers == 1
    assert converter(workers=0).publish_kwargs(3) == {"workers": 0}
