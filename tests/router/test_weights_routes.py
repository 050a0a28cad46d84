"""The admin weight routes refuse at once what a job could only fail on later, and a publish
without a version takes the next number: a real router process over a real local store, driven
over HTTP and through the ``mixfleet weights`` CLI as a subprocess.

- a checkpoint that does not exist, is a file, or has no ``config.json``: 400 naming the problem;
- a rollback to a version the store does not hold: 404 naming the version and format;
- ``publish`` without ``--version``, twice, then the trainer kit's publish without a version, then
  a rollback without one: four consecutive numbers (the router picks each under its job lock);
- ``mixfleet weights status`` whose reader closed the pipe (``| head -1``) exits 1, silently;
- a perturbation of a delta version starts from its full content;
- a version number beyond a batch's int64 (or not a JSON integer) is a 422 before any job;
- a job for a run other than the router's is a 400 before any job;
- the trainer kit's publish (``mixfleet demo``'s) while another weight job holds the job lock
  (shared Redis state) waits for it with one line, bounded: it starts once the job ends, or
  raises one 409 line naming its wait.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.procs import mixfleet_argv, redis_server
from tests.support.proxy import TcpProxy
from tests.support.router import router_process, write_preset
from tests.support.state import opened
from trainer.client import AsyncRolloutClient, RouterError

RUN = "r"


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    """The preset and the local store (``store/``) of :func:`weights_router`."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def weights_router(weights_dir: Path):
    """A router with one bf16 group (no replicas) and an empty local store, converting in-process."""
    d = weights_dir
    preset = write_preset(d / "preset.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    env = {"MIXFLEET_STORE": str(d / "store"), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    with router_process(preset, env=env) as handle:
        yield handle


def _post(router, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, headers=router.headers, json=body, timeout=60)


def _cli(router, *args: str, **kw) -> subprocess.CompletedProcess:
    env = {"MIXFLEET_URL": router.url, "MIXFLEET_API_KEY": router.key}
    return subprocess.run(
        mixfleet_argv("weights", *args), capture_output=True, text=True, timeout=300, env=_env(env), **kw
    )


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


def _latest(router) -> int | None:
    return httpx.get(router.url + "/v1/weights", headers=router.headers, timeout=30).json()["latest_version"]


def test_bad_checkpoints_are_refused_at_once(weights_router, tiny_dir: Path, tmp_path: Path) -> None:
    router = weights_router
    before = _latest(router)
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"not a directory")
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    for shard in tiny_dir.glob("*.safetensors"):
        shutil.copy(shard, no_config / shard.name)
    cases = [
        (tmp_path / "missing", "does not exist on the router's filesystem"),
        (a_file, "is not a directory on the router's filesystem"),
        (no_config, "has no config.json"),
        (Path("/" + "x" * 5000), "File name too long"),
    ]
    r = _post(router, "/v1/weights", {"checkpoint": str(tiny_dir), "formats": ["bf16", "mxfp4"]})
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith("no group of this fleet serves mxfp4 (it serves bf16)"), r.json()
    for path, reason in cases:
        r = _post(router, "/v1/weights", {"checkpoint": str(path)})
        assert r.status_code == 400, r.text
        assert str(path)[:200] in r.json()["detail"] and reason in r.json()["detail"], r.json()
        # the CLI says the router's reason in one line (the path is the router's to judge)
        done = _cli(router, "publish", "--no-wait", str(path))
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "HTTP 400" in done.stderr, done.stderr
        assert reason in done.stderr, done.stderr
    assert _latest(router) == before  # every refusal came before a job: nothing was published


def test_rollback_to_a_missing_version_is_refused_at_once(weights_router) -> None:
    before = _latest(weights_router)
    r = _post(weights_router, "/v1/weights/rollback", {"to": 7})
    assert r.status_code == 404, r.text
    assert r.json()["detail"] == (
        f"cannot roll back run {RUN!r} to version 7: no bf16 version 7 "
        "(never published, or pruned from the store)"
    )
    done = _cli(weights_router, "rollback", "--to", "7", "--no-wait")
    assert done.returncode == 2 and "HTTP 404" in done.stderr and "no bf16 version 7" in done.stderr
    assert _latest(weights_router) == before


def test_publishes_without_a_version_compose(weights_router, tiny_dir: Path) -> None:
    router = weights_router
    first = (_latest(router) or 0) + 1
    for expected in (first, first + 1):
        done = _cli(router, "publish", "--no-wait", "--json", str(tiny_dir))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["result"]["version"] == expected
    # the trainer kit's publish goes through the same route: no version, the next number
    from trainer.client import RolloutClient

    with RolloutClient(router.url, router.key) as client:
        job = client.publish(str(tiny_dir))
        assert job["version"] == first + 2 and job["state"] == "running", job
        assert client.wait_job(job["job_id"])["result"]["version"] == first + 2
        r = _post(router, "/v1/weights/rollback", {"to": first})
        assert r.status_code == 202 and r.json()["version"] == first + 3, r.text
        done = client.wait_job(r.json()["job_id"])
        assert done["result"]["version"] == first + 3 and done["result"]["content_of"] == first, done
    vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    for rows in ([1, 1], [-1, 5], [1, vocab]):  # refused before any job: nothing is published
        r = _post(router, "/v1/weights/perturbations", {"from_version": first, "swap_rows": rows})
        assert r.status_code == 400, r.text
        want = f"swap_rows must be two different token ids in [0, {vocab}), got {rows[0]}, {rows[1]}"
        assert r.json()["detail"] == want, r.json()
    assert _latest(router) == first + 3


def test_status_into_a_closed_pipe_exits_quietly(weights_router) -> None:
    """``mixfleet weights status | head -1`` where head has gone: no traceback, status 1."""
    env = _env({"MIXFLEET_URL": weights_router.url, "MIXFLEET_API_KEY": weights_router.key})
    proc = subprocess.Popen(
        mixfleet_argv("weights", "status"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.close()  # the reader is gone before the first line is written
    _, err = proc.communicate(timeout=120)
    assert err == b"" and proc.returncode == 1, err.decode()
    # through a shell pipe, as typed: the first line arrives and nothing else is said
    shell = subprocess.run(
        ["bash", "-c", 'set -o pipefail; "$@" | head -1', "sh", *mixfleet_argv("weights", "status")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert shell.stdout.startswith(f"run {RUN}: latest published version"), shell.stdout
    assert "Traceback" not in shell.stderr and "BrokenPipe" not in shell.stderr, shell.stderr


def test_a_perturbation_of_a_delta_version_swaps_its_full_content(
    weights_router, weights_dir: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    """A delta version stores only its changed files; the perturbation (``mixfleet weights
    verify``'s) starts from its full content, its base's files included."""
    import torch
    from safetensors.torch import load_file, save_file

    from trainer.client import RolloutClient
    from weight_sync.delta import link_version
    from weight_sync.store.local import LocalStore
    from weight_sync.types import VersionRef

    router = weights_router
    store = LocalStore(weights_dir / "store")
    delta = tmp_path / "delta"
    delta.mkdir()
    norm = load_file(str(tiny_dir / "model.safetensors"))["model.norm.weight"]
    save_file({"model.norm.weight": norm + 1}, str(delta / "model.safetensors"))
    with RolloutClient(router.url, router.key) as client:
        base = client.wait_job(client.publish(str(tiny_dir))["job_id"])["result"]["version"]
        r = _post(router, "/v1/weights", {"checkpoint": str(delta), "delta_of": base})
        assert r.status_code == 202, r.text
        v = client.wait_job(r.json()["job_id"])["result"]["version"]
        assert store.read_manifest(VersionRef(RUN, "bf16", v)).kind == "delta"
        assert not (store.version_dir(VersionRef(RUN, "bf16", v)) / "config.json").exists()
        r = _post(router, "/v1/weights/perturbations", {"from_version": v, "swap_rows": [3, 5]})
        assert r.status_code == 202, r.text
        p = client.wait_job(r.json()["job_id"])["result"]["version"]
    for version in (v, p):
        link_version(store, VersionRef(RUN, "bf16", version), tmp_path / f"v{version}")
    before = load_file(str(tmp_path / f"v{v}" / "model.safetensors"))
    after = load_file(str(tmp_path / f"v{p}" / "model.safetensors"))
    assert torch.equal(after["model.norm.weight"], norm + 1)  # the delta's tensor, kept
    w, x = before["lm_head.weight"], after["lm_head.weight"]
    assert torch.equal(x[3], w[5]) and torch.equal(x[5], w[3])
    assert (tmp_path / f"v{p}" / "config.json").is_file()


def test_version_numbers_beyond_what_a_batch_holds_are_refused(weights_router) -> None:
    """A version a batch's int64 versions cannot hold (or a version that is not a JSON integer) is
    a 422 before any job: published, it would make every batch of it undecodable."""
    before = _latest(weights_router)
    cases = [
        ("/v1/weights", {"checkpoint": "/nowhere", "version": 2**63}, "version"),
        ("/v1/weights", {"checkpoint": "/nowhere", "version": "3"}, "version"),
        ("/v1/weights", {"checkpoint": "/nowhere", "delta_of": 2**63}, "delta_of"),
        ("/v1/weights/rollback", {"to": 2**63}, "to"),
        ("/v1/weights/rollback", {"to": 1, "version": 2**64}, "version"),
        ("/v1/weights/perturbations", {"from_version": 2**63, "swap_rows": [1, 2]}, "from_version"),
        ("/v1/weights/perturbations", {"from_version": 1, "swap_rows": [1, True]}, "swap_rows"),
    ]
    for path, body, field in cases:
        r = _post(weights_router, path, body)
        assert r.status_code == 422, (body, r.text)
        assert [e["loc"][1] for e in r.json()["errors"]] == [field], (body, r.json())
    # beyond 64 bits (the body's decoder reads it as a float): refused naming the range too
    for path, body, field in [
        ("/v1/weights", {"checkpoint": "/nowhere", "version": 10**30}, "version"),
        ("/v1/weights/rollback", {"to": 10**30}, "to"),
        ("/v1/weights/prune", {"keep": 10**30}, "keep"),
    ]:
        r = _post(weights_router, path, body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["detail"].startswith(f"{field}: Input should be less than or equal to "), r.json()
    # swap_rows has no bound of its own (rows outside the model's are a 400 naming them): it names
    # the largest integer a body carries, as every unbounded integer does (router.schemas.unbounded_int)
    r = _post(weights_router, "/v1/weights/perturbations", {"from_version": 1, "swap_rows": [1, 10**30]})
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == "swap_rows.1: Input should be an integer below 2**64", r.json()
    assert _latest(weights_router) == before


def test_a_job_for_another_run_is_refused_at_once(weights_router, weights_dir: Path, tiny_dir: Path) -> None:
    """The router's replicas serve its own run only: a version of another run would never be
    activated, while the router counted it as its latest (every group lagging behind it) and
    ``weights publish`` waited for replicas that never come."""
    router = weights_router
    before = _latest(router)
    want = f"this router's fleet serves run {RUN!r}, not 'other'"
    for path, body in (
        ("/v1/weights", {"checkpoint": str(tiny_dir), "run_id": "other"}),
        ("/v1/weights/rollback", {"to": 0, "run_id": "other"}),
        ("/v1/weights/perturbations", {"from_version": 0, "swap_rows": [1, 2], "run_id": "other"}),
    ):
        r = _post(router, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["detail"].startswith(want), r.json()
    done = _cli(router, "publish", "--run", "other", str(tiny_dir))
    assert done.returncode == 2 and "HTTP 400" in done.stderr and want in done.stderr, done.stderr
    assert _latest(router) == before
    assert not (weights_dir / "store" / "other").exists()


def test_a_publish_waits_for_the_running_job_with_one_line_and_a_bound(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """Another weight job (of another router on the same Redis state: the test holds the job lock
    in the store as that router would) runs longer than the client's retries of the 409: the
    trainer kit's publish with ``wait_s`` (what ``mixfleet demo`` sends) tells its one line and
    waits; held past ``wait_s`` it raises one 409 line naming the wait; released meanwhile, the
    publish starts and its job is done."""
    preset = write_preset(tmp_path / "preset.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    env = {"MIXFLEET_STORE": str(tmp_path / "store"), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    lines: list[str] = []

    async def main(router, state: str) -> None:
        async with (
            opened(state) as store,
            AsyncRolloutClient(router.url, router.key, retries=1, max_backoff_s=1.0) as client,
        ):
            assert await store.acquire_job_lock("other-routers-job", 60.0)
            t0 = time.monotonic()
            with pytest.raises(RouterError) as err:
                await client.publish(str(tiny_dir), wait_s=1.5, on_wait=lines.append)
            assert 1.5 <= time.monotonic() - t0 < 5
            assert err.value.status == 409 and "\n" not in str(err.value), str(err.value)
            assert "already running (other-routers-job)" in str(err.value), str(err.value)
            assert str(err.value).endswith("(waited 1.5 s for it)"), str(err.value)
            assert lines == ["another weight job is running; waiting up to 1.5 s for it to end"]
            lines.clear()
            publishing = asyncio.create_task(client.publish(str(tiny_dir), wait_s=60, on_wait=lines.append))
            await asyncio.sleep(4.0)  # past the client's own retry of the 409 (1 s)
            assert not publishing.done()
            assert await store.release_job_lock("other-routers-job")
            async with asyncio.timeout(10):
                job = await publishing
            assert job["state"] == "running" and job["version"] == 1, job
            assert lines == ["another weight job is running; waiting up to 60 s for it to end"]
            assert (await client.wait_job(job["job_id"]))["result"]["version"] == 1

    with redis_server() as state, router_process(preset, state=state, env=env) as router:
        asyncio.run(main(router, state))


def test_a_store_root_that_cannot_be_a_directory_is_a_503_naming_it(tmp_path: Path) -> None:
    """``MIXFLEET_STORE`` naming a file: every weight route answers 503 naming the store (was a
    500 ``FileExistsError``)."""
    a_file = tmp_path / "store"
    a_file.write_text("x")
    preset = write_preset(tmp_path / "preset.toml", [{"name": "cpu-bf16", "weight_format": "bf16"}])
    env = {"MIXFLEET_STORE": str(a_file), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    with router_process(preset, env=env) as router:
        for method, path, body in (
            ("GET", "/v1/weights", None),
            ("POST", "/v1/weights", {"checkpoint": "/x"}),
        ):
            r = httpx.request(method, router.url + path, json=body, headers=router.headers, timeout=30)
            assert r.status_code == 503, r.text
            assert r.json()["detail"] == f"the weight store is unreadable: store {a_file}: not a directory"


def test_a_weight_job_request_sent_again_with_its_key_answers_the_job_it_started(
    weights_router, tiny_dir: Path
) -> None:
    """A publish whose 202 is lost (the router started the job) and that the trainer kit sends
    again, as it retries a lost answer: one job and one version, the retry answered with that job;
    it published the checkpoint once per attempt, or got a 409 naming its own job. Over HTTP: the
    same key and body name the same job, running or done; another body is another job."""
    router = weights_router
    before = _latest(router) or 0
    lost = {"n": 0}

    def hook(direction: str, chunk: bytes, conn: dict) -> bytes | None:
        if direction == "up" and chunk.startswith(b"POST /v1/weights "):
            conn["publish"] = True
        if direction == "down" and conn.get("publish") and lost["n"] == 0 and b" 202 " in chunk[:20]:
            lost["n"] += 1
            return None  # the job started; its answer is lost
        return chunk

    proxy = TcpProxy(("127.0.0.1", int(router.url.rsplit(":", 1)[1])), hook)
    try:
        from trainer.client import RolloutClient

        with RolloutClient(f"http://127.0.0.1:{proxy.port}", router.key) as client:
            job = client.publish(str(tiny_dir))
            assert lost["n"] == 1 and job["version"] == before + 1, job
            assert client.wait_job(job["job_id"])["result"]["version"] == before + 1
    finally:
        proxy.close()
    assert _latest(router) == before + 1
    key = {**router.headers, "Idempotency-Key": "publish-once"}
    body = {"checkpoint": str(tiny_dir)}
    first = httpx.post(router.url + "/v1/weights", headers=key, json=body, timeout=60)
    again = httpx.post(router.url + "/v1/weights", headers=key, json=body, timeout=60)
    assert first.status_code == again.status_code == 202, again.text
    assert again.json()["job_id"] == first.json()["job_id"] and again.json()["version"] == before + 2
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.get(f"/v1/weights/jobs/{first.json()['job_id']}").json()["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    done = httpx.post(router.url + "/v1/weights", headers=key, json=body, timeout=60)
    assert done.json()["job_id"] == first.json()["job_id"] and done.json()["state"] == "done", done.text
    assert _latest(router) == before + 2
    other = httpx.post(
        router.url + "/v1/weights", headers=key, json={**body, "version": before + 3}, timeout=60
    )
    assert other.status_code == 202 and other.json()["job_id"] != first.json()["job_id"], other.text
    with httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.get(f"/v1/weights/jobs/{other.json()['job_id']}").json()["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
    bad = httpx.post(
        router.url + "/v1/weights", headers={**key, "Idempotency-Key": "a b"}, json=body, timeout=60
    )
    assert bad.status_code == 422 and "Idempotency-Key" in bad.json()["detail"], bad.text


def test_a_rollback_numbered_below_the_pointers_is_refused_at_once(weights_router, tiny_dir: Path) -> None:
    """A rollback given a version older than the run's current one is a 409 before any job, as a
    publish's is (it was accepted, 202, and failed as a job)."""
    from trainer.client import RolloutClient

    router = weights_router
    with RolloutClient(router.url, router.key) as client:
        while (_latest(router) or 0) < 1:
            client.wait_job(client.publish(str(tiny_dir))["job_id"])
    latest = _latest(router)
    for path, body in (
        ("/v1/weights/rollback", {"to": latest, "version": latest - 1}),
        ("/v1/weights", {"checkpoint": str(tiny_dir), "version": latest - 1}),
    ):
        r = _post(router, path, body)
        assert r.status_code == 409, r.text
        assert r.json()["detail"].startswith(
            f"version {latest - 1} is older than run 'r''s current version {latest}"
        )
    assert _latest(router) == latest
