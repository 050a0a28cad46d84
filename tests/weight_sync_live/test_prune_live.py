"""A live fleet whose router prunes its store (``--keep-store-versions 1``), as ``mixfleet up`` runs
it: a real router, a real engine and sidecar staging in place (the engine loads the store's own
version directories), versions published through the router's HTTP API.

Each publish prunes what no replica serves any more, beyond the newest version: the store ends
with the served version and the new one; the engine whose first version's directory was deleted
keeps serving turns at the newest version; a rollback to a pruned version is a 404 naming it.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx

from tests.support.fleet import local_fleet
from tests.support.router import ALL_SCOPES, router_process, write_preset
from trainer.client import RolloutClient
from weight_sync.types import FormatRef

RUN = "prune-live"
STREAM = FormatRef(RUN, "bf16")


def test_a_live_fleet_prunes_what_no_replica_serves(
    tmp_path: Path, tiny_base: Path, tiny_seed2: Path
) -> None:
    key = secrets.token_hex(16)
    preset = write_preset(
        tmp_path / "preset.toml", [{"name": "cpu-bf16", "weight_format": "bf16", "min_replicas": 1}]
    )
    env = {"MIXFLEET_STORE": str(tmp_path / "store"), "MIXFLEET_RUN": RUN, "MIXFLEET_PUBLISH_WORKERS": "0"}
    with router_process(
        preset,
        keys={key: ALL_SCOPES},
        env=env,
        log=tmp_path / "router.log",
        extra_args=("--keep-store-versions", "1", "--heartbeat-timeout", "5"),
    ) as router:
        side_env = {"MIXFLEET_API_KEY": key, "MIXFLEET_URL": router.url}
        with (
            local_fleet(
                tmp_path,
                tiny_base,
                [("cpu-bf16", "bf16")],
                run_id=RUN,
                router_url=router.url,
                env=side_env,
                sidecar_flags=("--stage-mode", "inplace"),  # as mixfleet up runs its replicas
            ) as fleet,
            RolloutClient(router.url, key) as client,
            httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http,
        ):
            store = fleet.store
            for version, ckpt in ((2, tiny_seed2), (3, tiny_base), (4, tiny_seed2)):
                _wait_router_sees(http, router.url, version - 1)
                job = client.wait_job(client.publish(str(ckpt), version=version)["job_id"])
                fleet.wait_active(version, timeout=120)
                pruned = [e["deleted"] for e in job["events"] if e["kind"] == "pruned"]
                # the job pruned before publishing: the served version (version - 1) stayed
                assert pruned == ([] if version == 2 else [{"bf16": [version - 2]}]), job["events"]
            assert store.versions(STREAM) == [3, 4] and store.read_pointer(STREAM) == 4
            assert not (store.version_dir(STREAM.at(1))).exists()  # the engine's first directory

            sid = http.post(f"{router.url}/v1/sessions", json={"group": "cpu-bf16"}).json()["session_id"]
            r = http.post(
                f"{router.url}/v1/sessions/{sid}/turns",
                json={"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}},
            )
            assert r.status_code == 200, r.text
            assert [s["version"] for s in r.json()["weight_versions"]] == [4]

            r = http.post(f"{router.url}/v1/weights/rollback", json={"to": 1})
            assert r.status_code == 404 and "no bf16 version 1 (never published, or pruned" in r.text
            assert store.verify(STREAM.at(3)).version == 3 and store.verify(STREAM.at(4)).version == 4


def _wait_router_sees(http: httpx.Client, url: str, version: int, timeout: float = 60.0) -> None:
    """Until the router's registry has the replica fresh at ``version`` (what pruning reads)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        groups = http.get(f"{url}/v1/weights").json()["groups"]
        reps = [r for g in groups for r in g["replicas"]]
        if reps and all(r["fresh"] and r["active_version"] == version for r in reps):
            return
        assert time.monotonic() < deadline, groups
        time.sleep(0.1)
