"""A live local fleet for the validation ladder: a router, one engine + sidecar per group (bf16,
fp8, nvfp4) whose engines return routed experts and accept injected faults
(``MIXFLEET_ENGINE_FAULTS=1``, ``engine.server.debug``)."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from core.sglang_release import ENABLE_RETURN_ROUTED_EXPERTS_FLAG
from launcher.children import Replica
from tests.support.fleet import LOCAL_GROUPS, local_fleet
from tests.support.models import make_model_dir
from tests.support.procs import REPO, mixfleet_argv
from tests.support.router import ALL_SCOPES, RouterHandle, router_process, write_preset
from weight_sync.store.local import LocalStore

RUN = "run"


@dataclass
class Fleet:
    router: RouterHandle
    store: LocalStore
    replicas: list[Replica]
    env: dict[str, str]
    work: Path

    def replica(self, group: str) -> Replica:
        return next(r for r in self.replicas if r.group == group)

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            mixfleet_argv(*args),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
        )

    def weights(self) -> dict:
        r = httpx.get(self.router.url + "/v1/weights", headers=self.router.headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def latest(self) -> int:
        return int(self.weights()["latest_version"])

    def wait_active(self, version: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            st = self.weights()
            if all(r["active_version"] == version for g in st["groups"] for r in g["replicas"]):
                return
            assert time.monotonic() < deadline, f"not every replica at {version}: {st['groups']}"
            time.sleep(0.2)

    def republish(self) -> int:
        """Publish the latest version's content again as a new version (engines reload); wait."""
        h = self.router.headers
        job = httpx.post(
            self.router.url + "/v1/weights/rollback", headers=h, json={"to": self.latest()}, timeout=30
        )
        assert job.status_code == 202, job.text
        job = job.json()
        deadline = time.monotonic() + 120
        while job["state"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
            job = httpx.get(
                f"{self.router.url}/v1/weights/jobs/{job['job_id']}", headers=h, timeout=30
            ).json()
        assert job["state"] == "done", job
        self.wait_active(job["version"])
        return job["version"]

    def fault(self, group: str, body: dict) -> dict:
        r = httpx.post(self.replica(group).engine_url + "/debug/fault", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("validate-models"), "tiny", "bf16")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_base) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("validate-fleet")
    key = secrets.token_hex(16)
    preset = write_preset(
        work / "preset.toml",
        [
            {
                "name": g,
                "weight_format": f,
                "min_replicas": 1,
                **({"kv_cache_dtype": "fp8_e4m3"} if f == "fp8" else {}),
            }
            for g, f in LOCAL_GROUPS
        ],
    )
    store_root = work / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MIXFLEET_STORE", str(store_root))
        mp.setenv("MIXFLEET_RUN", RUN)
        mp.setenv("MIXFLEET_PUBLISH_WORKERS", "0")
        mp.setenv("MIXFLEET_ENGINE_FAULTS", "1")  # the engines inherit it: /debug/fault
        with router_process(
            preset, keys={key: ALL_SCOPES}, log=work / "router.log", extra_args=("--heartbeat-timeout", "5")
        ) as router:
            env = {"MIXFLEET_API_KEY": key, "MIXFLEET_URL": router.url, "MIXFLEET_STORE": str(store_root)}
            with local_fleet(
                work,
                tiny_base,
                run_id=RUN,
                router_url=router.url,
                env=env,
                engine_flags=(ENABLE_RETURN_ROUTED_EXPERTS_FLAG,),
            ) as lf:
                f = Fleet(router, lf.store, lf.replicas, env, work)
                f.wait_active(1)
                yield f
