"""Trainer log-prob uploads end to end: a real router process before a real engine. The trainer
takes a batch (trainer client, compact encoding), uploads log-probs it made from the batch's own
behavior log-probs plus known offsets, and the router's answer, ``/v1/groups`` and ``/metrics``
report exactly the figures computed here token by token; then the lease rule and every refusal."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import KEYS
from tests.support.procs import redis_server
from tests.support.router import router_process, write_preset
from trainer.client import RolloutClient
from trainer.upload import encode_trainer_logprobs

SP = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 5}
OFFSETS = (0.0, 0.5, -2.0, 1.0, 1.75, -0.25)  # log p - log q cycled over the batch's tokens, p <= 1
UPLOAD = {"Content-Type": "application/x-mixfleet-logprobs"}
LONG = {**SP, "max_new_tokens": 64}


def _bucket(pos: int) -> str:
    return "0-63" if pos < 64 else "64-255" if pos < 256 else "256-1023" if pos < 1024 else "1024+"


def _finished_sessions(client: httpx.Client, n: int) -> list[str]:
    sids = []
    for k in range(n):
        sid = client.post("/v1/sessions", json={"group": "cpu-a"}).json()["session_id"]
        for prompt in ([3, 4, 5 + k], list(range(1, 70))):  # the second turn's tokens sit at 69+
            r = client.post(f"/v1/sessions/{sid}/turns", json={"input_ids": prompt, "sampling_params": SP})
            assert r.status_code == 200, r.text
        assert client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
        sids.append(sid)
    return sids


def _expected(batch, p: np.ndarray, band=(0.2, 5.0)) -> dict[str, dict]:
    """Per position bucket and in total, the figures computed here token by token (math, fsum)."""
    rows: dict[str, list[tuple[float, float, bool, bool]]] = {}
    for t in batch.turns:
        prompt = len(t["input_ids"])
        for i in range(t["token_start"], t["token_end"]):
            q = float(batch.logprobs[i])
            d = float(p[i]) - q
            r = math.exp(d)
            row = (r - 1 - d, abs(d), not 0.2 <= r <= 5.0, not band[0] <= r <= band[1])
            rows.setdefault(_bucket(prompt + i - t["token_start"]), []).append(row)
    rows["total"] = [x for b in list(rows) for x in rows[b]]
    out = {}
    for key, xs in rows.items():
        n = len(xs)
        out[key] = {
            "tokens": n,
            "k3_kl": math.fsum(x[0] for x in xs) / n,
            "abs_logprob_diff_mean": math.fsum(x[1] for x in xs) / n,
            "extreme_share": sum(x[2] for x in xs) / n,
            "out_of_band_share": sum(x[3] for x in xs) / n,
        }
    return out


def _same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["extreme_share"] == want["extreme_share"]
    assert got["out_of_band_share"] == want["out_of_band_share"]
    for k in ("k3_kl", "abs_logprob_diff_mean"):
        assert math.isclose(got[k], want[k], rel_tol=1e-12, abs_tol=1e-15), (k, got[k], want[k])


def _metrics(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_upload_figures_in_answer_groups_and_metrics(router, client: httpx.Client) -> None:
    sids = _finished_sessions(client, 2)
    with RolloutClient(router.url, KEYS["trainer"]) as trainer:
        batch = trainer.take(8, wait_s=5)
        assert batch.lease_id and {t["session_id"] for t in batch.trajectories} == set(sids)
        assert (batch.versions == 0).all()
        d = np.resize(np.array(OFFSETS), len(batch))
        p = np.minimum(batch.logprobs.astype(np.float64) + d, 0.0).astype(np.float32)
        answer = trainer.upload_trainer_logprobs(batch.lease_id, p)
        want = _expected(batch, p)
        assert answer["lease_id"] == batch.lease_id
        assert (answer["tokens"], answer["skipped"]) == (len(batch), 0)
        [g] = answer["groups"]
        assert (g["group"], g["version"]) == ("cpu-a", 0)
        _same(g, want["total"])
        # the offsets reach outside the band, and the second turns' tokens sit in bucket 64-255
        assert want["total"]["extreme_share"] > 0 and want["64-255"]["tokens"] > 0

        groups = {x["name"]: x for x in client.get("/v1/groups").json()["groups"]}
        mm = groups["cpu-a"]["mismatch"]
        assert mm["band"] == [0.2, 5.0] and mm["extreme_band"] == [0.2, 5.0]
        _same(mm, want["total"])
        [v0] = mm["versions"]
        assert v0["version"] == 0
        _same(v0, want["total"])
        assert [b["bucket"] for b in mm["positions"]] == [b for b in ("0-63", "64-255") if b in want]
        for b in mm["positions"]:
            _same(b, want[b["bucket"]])
        assert groups["cpu-b"]["mismatch"]["tokens"] == 0

        m = _metrics(client)
        ga = (("group", "cpu-a"),)
        gv = (("group", "cpu-a"), ("version", "0"))
        n = want["total"]["tokens"]
        assert m[("mixfleet_mismatch_tokens_total", ga)] == n
        assert math.isclose(m[("mixfleet_mismatch_k3_total", ga)], want["total"]["k3_kl"] * n, rel_tol=1e-12)
        assert m[("mixfleet_mismatch_extreme_tokens_total", ga)] == round(want["total"]["extreme_share"] * n)
        assert m[("mixfleet_mismatch_out_of_band_tokens_total", ga)] == round(
            want["total"]["out_of_band_share"] * n
        )
        assert math.isclose(m[("mixfleet_mismatch_k3_kl", gv)], want["total"]["k3_kl"], rel_tol=1e-12)
        assert m[("mixfleet_mismatch_extreme_ratio_share", gv)] == want["total"]["extreme_share"]
        gp = (("group", "cpu-a"), ("position", "64-255"))
        assert m[("mixfleet_mismatch_position_tokens", gp)] == want["64-255"]["tokens"]
        assert m[("mixfleet_mismatch_band_info", (("high", "5"), ("low", "0.2")))] == 1

        # once per lease: a repeat of the same bytes (a retry whose answer was lost) answers the
        # same figures and counts nothing; other log-probs are refused and change nothing
        path = f"/v1/batches/{batch.lease_id}/trainer_logprobs"
        again = client.post(path, content=encode_trainer_logprobs(p), headers=UPLOAD)
        assert again.status_code == 200, again.text
        assert again.json() == {**answer, "already_uploaded": True} and answer["already_uploaded"] is False
        other = client.post(path, content=encode_trainer_logprobs(p - 0.25), headers=UPLOAD)
        assert other.status_code == 409 and "already uploaded" in other.json()["detail"]
        assert _metrics(client)[("mixfleet_mismatch_tokens_total", ga)] == n
        assert trainer.ack(batch.lease_id)["acked"] == 2


def test_an_acknowledged_lease_still_takes_its_upload(router, client: httpx.Client) -> None:
    _finished_sessions(client, 1)
    with RolloutClient(router.url, KEYS["trainer"]) as trainer:
        batch = trainer.take(8, wait_s=5)
        assert trainer.ack(batch.lease_id)["acked"] == 1
        answer = trainer.upload_trainer_logprobs(batch.lease_id, batch.logprobs)  # p == q
        assert answer["tokens"] == len(batch) and answer["groups"][0]["k3_kl"] == 0.0


def test_refusals(router, client: httpx.Client) -> None:
    _finished_sessions(client, 1)
    with RolloutClient(router.url, KEYS["trainer"]) as trainer:
        batch = trainer.take(8, wait_s=5)
    path = f"/v1/batches/{batch.lease_id}/trainer_logprobs"
    before = _metrics(client).get(("mixfleet_mismatch_tokens_total", (("group", "cpu-a"),)), 0)

    def post(body: bytes, p: str = path, key: str = KEYS["trainer"]) -> httpx.Response:
        return client.post(p, content=body, headers={**UPLOAD, "Authorization": f"Bearer {key}"})

    r = post(encode_trainer_logprobs(np.zeros(3)), "/v1/batches/no-such-lease/trainer_logprobs")
    assert r.status_code == 422 and r.json()["detail"].startswith("lease_id: String should match pattern")
    r = post(encode_trainer_logprobs(np.zeros(3)), f"/v1/batches/{'0' * 32}/trainer_logprobs")
    assert r.status_code == 404 and f"unknown lease '{'0' * 32}'" in r.json()["detail"]
    r = post(encode_trainer_logprobs(np.zeros(len(batch) + 1)))
    assert r.status_code == 422
    assert r.json()["detail"] == f"body: {len(batch) + 1} trainer log-probs for {len(batch)} output tokens"
    nan = np.zeros(len(batch))
    nan[1] = np.nan
    r = post(encode_trainer_logprobs(nan))
    assert r.status_code == 422 and "trainer log-prob 1 is not finite" in r.json()["detail"]
    masked = batch.logprobs.copy()
    masked[[1, 3]] = -1e30  # a trainer that masked logits with a huge negative constant
    r = post(encode_trainer_logprobs(masked))
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "body: trainer log-prob 1 is -1e+30, below -10000: a masking constant, not the log-prob of a "
        "sampled token"
    )
    r = post(encode_trainer_logprobs(np.full(len(batch), np.finfo(np.float32).min)))
    assert r.status_code == 422 and "trainer log-prob 0 is -3.40282e+38, below -10000" in r.json()["detail"]
    r = post(b'{"logprobs": [1, 2]}')
    assert r.status_code == 400 and r.json()["detail"].startswith("body: upload starts with b'{\"l'")
    upload = encode_trainer_logprobs(batch.logprobs)
    auth = {"Authorization": f"Bearer {KEYS['trainer']}"}
    for headers, sent in (
        ({"Content-Type": "application/json"}, "Content-Type 'application/json'"),
        ({"Content-Type": "application/octet-stream"}, "Content-Type 'application/octet-stream'"),
        ({}, "no Content-Type"),
    ):
        r = client.post(path, content=upload, headers={**auth, **headers})
        assert r.status_code == 415, r.text
        assert r.json()["detail"] == (
            f"body: {sent}; the upload takes application/x-mixfleet-logprobs (trainer/upload.py "
            "encode_trainer_logprobs)"
        )
    r = client.post(path, json={"logprobs": [1, 2]}, headers=auth)
    assert r.status_code == 415 and "Content-Type 'application/json'" in r.json()["detail"], r.text
    r = post(b"")
    assert r.status_code == 400 and "shorter than its 8-byte header" in r.json()["detail"]
    assert post(encode_trainer_logprobs(np.zeros(len(batch))), key=KEYS["rollout"]).status_code == 403
    after = _metrics(client).get(("mixfleet_mismatch_tokens_total", (("group", "cpu-a"),)), 0)
    assert after == before  # nothing refused was counted
    assert post(encode_trainer_logprobs(batch.logprobs)).status_code == 200
    client.post(f"/v1/batches/{batch.lease_id}/ack")


def test_an_upload_over_the_routers_body_limit_is_taken_at_its_leases_size(engine_url, tmp_path) -> None:
    """The router's ``--max-body-bytes`` (1024 here, 256 log-probs) holds every route but the
    log-prob upload, which takes its lease's size, however large: ``8 + 4n`` bytes for ``n``
    tokens, ``12 + 5n`` with route flags, through the trainer kit; a larger body is a 413 naming
    those sizes, declared or sent chunked, several MB too; nothing refused is counted."""
    preset = write_preset(tmp_path / "preset.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    keys = {KEYS["all"]: ["rollout", "trainer", "admin"]}
    with (
        router_process(preset, keys=keys, extra_args=("--max-body-bytes", "1024")) as router,
        httpx.Client(base_url=router.url, headers=router.headers, timeout=60) as c,
        RolloutClient(router.url, KEYS["all"]) as trainer,
    ):
        tokens = 0
        while tokens <= 300:  # more log-probs than 1024 bytes carry
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            turn = c.post(f"/v1/sessions/{sid}/turns", json={"input_ids": [3, 4], "sampling_params": LONG})
            tokens += len(turn.json()["output_ids"])
            assert c.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0}).status_code == 200
        batch = trainer.take(64, wait_s=5)
        n = len(batch)
        assert n == tokens and 8 + 4 * n > 1024
        path = f"/v1/batches/{batch.lease_id}/trainer_logprobs"
        sizes = f"lease {batch.lease_id}'s upload of {n} log-probs is {8 + 4 * n} bytes"
        sizes += f" ({12 + 5 * n} with route flags)"
        flags = np.full(n, 2, dtype=np.uint8)
        over = encode_trainer_logprobs(np.zeros(n + 1), np.full(n + 1, 2))
        chunks = iter([over[i : i + 512] for i in range(0, len(over), 512)])
        huge = encode_trainer_logprobs(np.zeros(2_000_000))  # 8 MB
        for body, size in (
            (over, f"body: {len(over)} bytes"),
            (chunks, "body"),
            (huge, f"body: {len(huge)} bytes"),
        ):
            r = c.post(path, content=body, headers=UPLOAD)
            assert r.status_code == 413, r.text
            assert r.json()["detail"] == f"{size} exceeds the limit of {12 + 5 * n} bytes: {sizes}"
        r = c.post(f"/v1/batches/{'0' * 32}/trainer_logprobs", content=huge, headers=UPLOAD)
        assert r.status_code == 404  # the lease is looked up before the body is read
        r = c.post("/v1/sessions", json={"metadata": {"x": "y" * 2000}})  # every other route: the limit
        assert r.status_code == 413 and "limit of 1024 bytes" in r.json()["detail"], r.text
        assert c.get("/v1/groups").json()["groups"][0]["mismatch"]["tokens"] == 0
        answer = trainer.upload_trainer_logprobs(batch.lease_id, batch.logprobs, flags)
        assert (answer["tokens"], answer["groups"][0]["k3_kl"]) == (n, 0.0)
        assert c.get("/v1/groups").json()["groups"][0]["mismatch"]["tokens"] == n
        trainer.ack(batch.lease_id)


@pytest.fixture(autouse=True)
def _drained(client: httpx.Client):
    """Each test starts with an empty ready queue."""
    taken = client.post("/v1/batches/take", json={"size": 100}).json()
    if taken["lease_id"]:
        client.post(f"/v1/batches/{taken['lease_id']}/ack")
    yield


def test_on_redis_the_figures_survive_a_router_restart(engine_url, tmp_path) -> None:
    """Two router processes in turn on one real redis-server: the second reports the first's
    figures and still refuses the first's lease a second upload."""
    preset = write_preset(tmp_path / "preset.toml", [{"name": "cpu-a", "replicas": [engine_url]}])
    keys = {KEYS["all"]: ["rollout", "trainer", "admin"]}
    with redis_server() as url:
        with (
            router_process(preset, state=url, keys=keys) as first,
            httpx.Client(base_url=first.url, headers=first.headers, timeout=60) as c,
        ):
            _finished_sessions(c, 1)
            with RolloutClient(first.url, KEYS["all"]) as trainer:
                batch = trainer.take(8, wait_s=5)
                d = np.resize(np.array(OFFSETS), len(batch))
                p = np.minimum(batch.logprobs.astype(np.float64) + d, 0.0).astype(np.float32)
                trainer.upload_trainer_logprobs(batch.lease_id, p)
                trainer.ack(batch.lease_id)
            want = _expected(batch, p)
            before = c.get("/v1/groups").json()["groups"][0]["mismatch"]
            _same(before, want["total"])
        with (
            router_process(preset, state=url, keys=keys) as second,
            httpx.Client(base_url=second.url, headers=second.headers, timeout=60) as c,
        ):
            assert c.get("/v1/groups").json()["groups"][0]["mismatch"] == before
            path = f"/v1/batches/{batch.lease_id}/trainer_logprobs"
            again = c.post(path, content=encode_trainer_logprobs(p), headers=UPLOAD)
            assert again.status_code == 200 and again.json()["already_uploaded"] is True, again.text
            other = c.post(path, content=encode_trainer_logprobs(p - 0.25), headers=UPLOAD)
            assert other.status_code == 409, other.text
            m = _metrics(c)
            assert m[("mixfleet_mismatch_tokens_total", (("group", "cpu-a"),))] == want["total"]["tokens"]
