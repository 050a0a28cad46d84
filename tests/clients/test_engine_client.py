"""The one engine client (clients.engine.SGLangClient) against a real local engine and
real loopback servers: the engine request it builds, scoring, the weight-update protocol, info,
health and metrics, and how it classifies every failure (refused, timed out, a pooled connection
the server dropped, 4xx / 409 / 5xx, bodies that are not JSON, response framings)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.engine import (
    EngineAborted,
    EngineRejected,
    EngineUnavailable,
    SGLangClient,
    WeightsNotFlushed,
    make_http_client,
)
from core.sglang_release import update_weights_request
from replica.reconciler import parse_prometheus
from tests.engine.test_generate import _hf_logprobs
from tests.support.engines import engine_process
from tests.support.procs import free_port

PROMPT = [256, 72, 101, 108, 108, 111, 33, 10]


class Server:
    """A loopback HTTP/1.1 server answering every request with ``answer(n)`` (raw bytes; ``n``
    counts answered requests), optionally closing the connection afterwards, or closing it without
    an answer when a second request arrives on it (``drop_reused``), or sleeping first (``delay``:
    seconds, or a function of ``n``). Records request heads and bodies."""

    def __init__(self, answer, *, close_after: bool = False, drop_reused: bool = False, delay=0.0) -> None:
        self.answer = answer
        self.close_after = close_after
        self.drop_reused = drop_reused
        self.dropped = 0
        self.delay = delay
        self.connections = 0
        self.requests = 0
        self.open_now = 0
        self.max_open = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self.port = free_port()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        try:
            served = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                if self.drop_reused and served:
                    self.dropped += 1
                    break  # a keep-alive close racing the request: no byte of an answer
                served += 1
                self.requests += 1
                delay = self.delay(self.requests) if callable(self.delay) else self.delay
                if delay:
                    await asyncio.sleep(delay)
                writer.write(self.answer(self.requests))
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_now -= 1
            writer.close()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def answer(status: str, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


async def with_client(url: str, call, **pool):
    http = make_http_client(**pool)
    try:
        return await call(SGLangClient(http, url))
    finally:
        await http.close()


def run(url: str, call, **pool):
    return asyncio.run(with_client(url, call, **pool))


# --- against a real engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[str]:
    with engine_process(tiny_dir, weight_version=3) as url:
        yield url


def test_generate_returns_the_behavior_records_of_the_sampled_tokens(engine: str) -> None:
    params = {"temperature": 0.8, "top_k": 20, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 5}
    out = run(engine, lambda c: c.generate(PROMPT, params, headers={"Modal-Session-ID": "s1"}))
    assert out.request.top_k_bound is None and out.sampling is None and out.request.params == params
    ids, meta = out.body["output_ids"], out.body["meta_info"]
    assert len(ids) == 6 and meta["completion_tokens"] == 6
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids  # return_logprob was sent
    masks = meta["output_token_sampling_mask"]  # return_sampling_mask was sent
    assert len(masks) == 6 and all(
        tok in mask and len(mask) <= 20 for tok, mask in zip(ids, masks, strict=True)
    )
    assert meta["weight_version"] == "3"


MASK = {"return_sampling_mask": True, "sampling_logprobs_mode": "support"}
UNFILTERED = {"temperature": 0.7, "top_k": -1, "top_p": 1.0, "min_p": 0.0}


@pytest.mark.parametrize(
    ("params", "sent_params", "mask", "sampling"),
    [
        # no filter: sent unchanged, no mask asked (SGLang's whole-vocabulary sampling), and said so
        ({"max_new_tokens": 3}, {"max_new_tokens": 3}, {}, {"sampling_mask": False}),
        (UNFILTERED, UNFILTERED, {}, {"sampling_mask": False}),
        # no finite top_k but a top-p / min-p filter: SGLang's --sampling-mask-max-tokens default
        ({"top_p": 0.9}, {"top_p": 0.9, "top_k": 4096}, MASK, {"top_k_bound": 4096}),
        ({"min_p": 0.1, "top_k": -1}, {"min_p": 0.1, "top_k": 4096}, MASK, {"top_k_bound": 4096}),
        # a finite top_k, and greedy (SGLang's top_k 1): a mask, sent as given
        ({"top_k": 7}, {"top_k": 7}, MASK, None),
        ({"temperature": 0.0}, {"temperature": 0.0}, MASK, None),
    ],
    ids=json.dumps,
)
def test_generate_sends_the_one_engine_request(params, sent_params, mask, sampling) -> None:
    async def main() -> None:
        async with Server(lambda n: ok(b'{"output_ids":[],"meta_info":{}}')) as srv:
            out = await with_client(srv.url, lambda c: c.generate([1, 2], params, headers={"X-A": "b"}))
        assert out.body == {"output_ids": [], "meta_info": {}}
        assert out.sampling == sampling and out.request.params == sent_params
        assert json.loads(srv.bodies[0]) == {
            "input_ids": [1, 2],
            "sampling_params": sent_params,
            "return_logprob": True,
            **mask,
        }
        head = srv.heads[0].decode().lower()
        assert head.startswith("post /generate http/1.1\r\n")
        assert "x-a: b\r\n" in head and "content-type: application/json\r\n" in head

    asyncio.run(main())


def test_generate_sends_an_id_array_as_the_json_list_of_its_ids() -> None:
    """A turn's input travels as one uint32 array (:mod:`router.segments`: the stored context and
    the appended ids, concatenated); the engine gets exactly the JSON list of those ids."""
    from router.segments import as_ids, locate, pack

    stored = pack(range(2**31 - 5, 2**31))  # the largest ids a request may carry
    whole, _ = locate(None, as_ids([0, 7, 300, 70_000]), stored)
    expected = [*range(2**31 - 5, 2**31), 0, 7, 300, 70_000]

    async def main() -> None:
        async with Server(lambda n: ok(b'{"output_ids":[],"meta_info":{}}')) as srv:
            await with_client(srv.url, lambda c: c.generate(whole, {"max_new_tokens": 3}))
            await with_client(srv.url, lambda c: c.generate(whole[5:7], {"max_new_tokens": 3}))
            await with_client(srv.url, lambda c: c.generate(whole[::2], {"max_new_tokens": 3}))  # strided
        assert [json.loads(b)["input_ids"] for b in srv.bodies] == [expected, [0, 7], expected[::2]]

    asyncio.run(main())


def test_score_matches_transformers_and_shares_the_prefix(engine: str, tiny_dir: Path) -> None:
    seqs = [[*PROMPT, 33], [*PROMPT, 65]]
    full = run(engine, lambda c: c.score(seqs, 0))
    tail = run(engine, lambda c: c.score(seqs, 4))
    assert len(full) == len(tail) == 2
    for seq, meta, short in zip(seqs, full, tail, strict=True):
        got = meta["input_token_logprobs"]
        assert [t for _, t, _ in got] == seq and got[0][0] is None
        assert [lp for lp, _, _ in got[1:]] == pytest.approx(_hf_logprobs(tiny_dir, seq, 1.0), abs=2e-4)
        assert short["input_token_logprobs"] == got[4:]
        assert meta["weight_version"] == "3"
    a, b = (m["input_token_logprobs"][:-1] for m in full)
    assert a == b  # the same prefix scores the same in one batch


def test_pause_update_continue_and_a_refused_update(engine: str, tiny_dir: Path) -> None:
    async def main(c: SGLangClient) -> None:
        assert await c.weight_version() == 3
        await c.pause_generation()  # the fleet's mode: retract
        message = await c.update_weights_from_disk(update_weights_request(str(tiny_dir), 4, "bf16"))
        await c.continue_generation()
        assert "Weight version updated to 4" in message
        assert await c.weight_version() == 4
        assert (await c.server_info())["weight_version"] == "3"  # SGLang: the start-up value
        with pytest.raises(EngineRejected) as refused:
            await c.update_weights_from_disk(update_weights_request(str(tiny_dir / "missing"), 5, "bf16"))
        assert refused.value.status == 400 and not refused.value.retryable
        assert not isinstance(refused.value, WeightsNotFlushed)
        assert await c.weight_version() == 4  # the old version keeps serving
        out = await c.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})
        assert out.body["meta_info"]["weight_version"] == "4"

    run(engine, main)


def test_an_update_whose_flush_is_refused_then_flush_and_version(engine: str, tiny_dir: Path) -> None:
    """Under an in-place pause with a request running, the update swaps the weights but its flush
    is refused: the client raises WeightsNotFlushed, /flush_cache is refused too; after a retract
    the flush succeeds and /update_weight_version makes /model_info name the version served."""

    async def main(c: SGLangClient) -> None:
        before = await c.weight_version()
        body = json.dumps(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        ).encode()
        tokens = parse_prometheus(await c.metrics()).get("sglang:generation_tokens_total", 0.0)
        running = asyncio.create_task(c.post_generate(body))
        while parse_prometheus(await c.metrics()).get("sglang:generation_tokens_total", 0.0) < tokens + 5:
            await asyncio.sleep(0.01)
        await c.pause_generation("in_place")
        try:
            with pytest.raises(WeightsNotFlushed) as not_flushed:
                await c.update_weights_from_disk(update_weights_request(str(tiny_dir), before + 1, "bf16"))
            assert not_flushed.value.status == 400
            assert await c.weight_version() == before
            with pytest.raises(EngineRejected) as flush_refused:
                await c.flush_cache()
            assert flush_refused.value.status == 400 and "Flush cache failed" in flush_refused.value.message
            await c.pause_generation("retract")
            await c.flush_cache()
            await c.update_weight_version(before + 1)
            assert await c.weight_version() == before + 1
        finally:
            await c.continue_generation()
        answer = json.loads((await running).content)
        spans = answer["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == [str(before), str(before + 1)], spans

    run(engine, main)


def test_info_health_metrics_and_flush(engine: str, tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())

    async def main(c: SGLangClient) -> None:
        assert (await c.model_info())["architectures"] == config["architectures"]
        info = await c.server_info()
        assert info["context_length"] == config["max_position_embeddings"]
        assert info["internal_states"][0]["num_running_reqs"] == 0
        assert await c.health() and await c.probe() == "ok"
        assert "sglang:num_running_reqs" in await c.metrics()
        await c.flush_cache()

    run(engine, main)


def test_generate_refused_by_the_engine_is_rejected_with_its_message(engine: str) -> None:
    with pytest.raises(EngineRejected) as bad:
        run(engine, lambda c: c.generate([1, 2], {"max_new_tokens": 2, "temperature": -1.0}))
    assert bad.value.status == 400 and "temperature" in bad.value.message


def test_an_aborted_generation_raises_engine_aborted(engine: str) -> None:
    """The local engine answers an aborted request 200 with finish reason abort, as SGLang does for
    an abort without a status (``/abort_request``): the client discards it as unavailable."""

    async def main(c: SGLangClient) -> None:
        params = {"temperature": 1.0, "top_k": 5, "max_new_tokens": 1500, "ignore_eos": True}
        turn = asyncio.create_task(c.generate(PROMPT, params))
        for _ in range(200):  # until the engine runs it
            await asyncio.sleep(0.05)
            if (await c.server_info())["internal_states"][0]["num_running_reqs"]:
                break
        r = await c.forward("POST", "/abort_request", json.dumps({"abort_all": True}).encode())
        assert r.status_code == 200
        with pytest.raises(EngineAborted) as aborted:
            await turn
        assert isinstance(aborted.value, EngineUnavailable)
        assert "aborted the generation: Aborted by /abort_request." in aborted.value.message

    run(engine, main)


# --- error classification against loopback servers ---------------------------------------------


def test_keep_alive_reuses_one_connection() -> None:
    async def main() -> None:
        async with Server(lambda n: ok(b'{"n":%d}' % n)) as srv:

            async def calls(c: SGLangClient) -> list:
                return [(await c.post_generate(b'{"i":%d}' % i)).json() for i in range(5)]

            got = await with_client(srv.url, calls)
        assert got == [{"n": i + 1} for i in range(5)]
        assert srv.connections == 1 and srv.bodies == [b'{"i":%d}' % i for i in range(5)]

    asyncio.run(main())


def test_a_connection_the_server_dropped_is_retried_on_a_fresh_one() -> None:
    async def main() -> None:
        # the server closes after each answer without saying so: the pooled connection is dead
        # when reused, and the request must still succeed (once, on a new connection)
        async with Server(lambda n: ok(), close_after=True) as srv:

            async def calls(c: SGLangClient) -> None:
                for _ in range(3):
                    assert (await c.post_generate(b"{}")).status_code == 200
                    await asyncio.sleep(0.05)  # let the close arrive

            await with_client(srv.url, calls)
        assert srv.requests == 3 and srv.connections == 3

    asyncio.run(main())


def test_a_request_the_server_closed_under_without_answering_is_resent_once() -> None:
    async def main() -> None:
        # every reused connection is closed when the next request arrives on it, before any byte
        # of an answer: each such request must be resent once on a fresh connection
        async with Server(lambda n: ok(b"%d" % n), drop_reused=True) as srv:

            async def calls(c: SGLangClient) -> list[bytes]:
                return [(await c.post_generate(b'{"i":%d}' % i)).content for i in range(3)]

            assert await with_client(srv.url, calls) == [b"1", b"2", b"3"]
        assert srv.dropped == 2 and srv.connections == 3
        assert srv.bodies == [b'{"i":0}', b'{"i":1}', b'{"i":1}', b'{"i":2}', b'{"i":2}']

    asyncio.run(main())


def test_refused_and_timed_out_requests_are_engine_unavailable() -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(EngineUnavailable) as refused:
            await with_client(dead, lambda c: c.post_generate(b"{}"))
        assert "Timeout" not in refused.value.message
        assert await with_client(dead, lambda c: c.probe()) == "unreachable"
        delays = {1: 0.0, 2: 2.0, 3: 0.0}
        async with Server(lambda n: ok(b"%d" % n), delay=lambda n: delays.get(n, 0.0)) as srv:

            async def calls(c: SGLangClient) -> None:
                assert (await c.post_generate(b"{}")).content == b"1"
                with pytest.raises(EngineUnavailable, match="Timeout"):
                    await c.post_generate(b"{}")
                assert (await c.post_generate(b"{}")).content == b"3"  # quick ones never time out

            await with_client(srv.url, calls, timeout_s=0.4)
        async with Server(lambda n: ok(), delay=1.0) as srv:
            assert await with_client(srv.url, lambda c: c.probe(timeout=0.2)) == "timeout"

    asyncio.run(main())


def test_statuses_are_classified() -> None:
    answers = {
        1: answer("503 Service Unavailable", b'{"error":{"message":"overloaded"}}'),
        2: answer("422 Unprocessable Entity", b'{"detail":"bad field"}'),
        3: answer("409 Conflict", b'{"message":"serves version 2, the request needs min_version 3"}'),
        4: answer("400 Bad Request", b'{"error":{"message":"bad"}}'),
        5: answer("200 OK", b"not json"),
        6: answer("409 Conflict", b'{"message":"needs 3"}'),
        7: answer("503 Service Unavailable", b"{}"),
    }

    async def main() -> None:
        async with Server(lambda n: answers[n]) as srv:

            async def calls(c: SGLangClient) -> None:
                with pytest.raises(EngineUnavailable, match="HTTP 503: overloaded"):
                    await c.generate([1], {})
                with pytest.raises(EngineRejected) as rejected:
                    await c.generate([1], {})
                assert rejected.value.status == 422 and rejected.value.message == "bad field"
                assert not rejected.value.retryable
                with pytest.raises(EngineRejected) as conflict:
                    await c.generate([1], {})
                assert conflict.value.retryable and "min_version 3" in conflict.value.message
                passed = await c.post_generate(b"{}")  # a 4xx is the request's own: passed through
                assert passed.status_code == 400 and passed.json() == {"error": {"message": "bad"}}
                with pytest.raises(EngineUnavailable, match="not JSON"):
                    await c.generate([1], {})
                with pytest.raises(EngineRejected) as passthrough_conflict:
                    await c.post_generate(b"{}")  # another replica may meet the constraint
                assert passthrough_conflict.value.retryable
                with pytest.raises(EngineUnavailable, match="HTTP 503"):
                    await c.post_generate(b"{}")

            await with_client(srv.url, calls)

    asyncio.run(main())


def test_weight_answers_are_read_only_in_sglangs_form() -> None:
    """SGLang answers an update or a version update 200 only with ``success: true`` (a refusal
    is a 400; entrypoints/http_server.py 1300-1326, 1527-1556) and echoes the version as the
    string sent: any other 200 is no answer the client can trust (EngineUnavailable)."""
    answers = {
        1: answer("200 OK", b'{"success":false,"message":"refused","num_paused_requests":0}'),
        2: answer("200 OK", b'{"success":true,"num_paused_requests":0}'),
        3: answer("200 OK", b'{"success":false,"message":"refused"}'),
        4: answer("200 OK", b'{"success":true,"message":"Weight version updated to 4","new_version":4}'),
        5: answer("200 OK", b'{"success":true,"message":"Succeeded.","num_paused_requests":0}'),
        6: answer("200 OK", b'{"success":true,"message":"Weight version updated to 4","new_version":"4"}'),
    }

    async def main() -> None:
        async with Server(lambda n: answers[n]) as srv:

            async def calls(c: SGLangClient) -> None:
                for _ in range(2):
                    with pytest.raises(EngineUnavailable, match="not SGLang's answer"):
                        await c.update_weights_from_disk({"model_path": "/m"})
                for _ in range(2):
                    with pytest.raises(EngineUnavailable, match="not SGLang's answer"):
                        await c.update_weight_version(4)
                assert await c.update_weights_from_disk({"model_path": "/m"}) == "Succeeded."
                await c.update_weight_version(4)

            await with_client(srv.url, calls)

    asyncio.run(main())


def test_info_is_read_from_sglangs_path_only() -> None:
    """SGLang 0.5.23 serves /model_info and /server_info (entrypoints/http_server.py 812, 863):
    an engine that answers 404 there is refused, not asked its deprecated /get_* alias."""
    info = answer("200 OK", b'{"weight_version":"3"}')
    answers = {1: answer("404 Not Found", b'{"detail":"Not Found"}'), 2: info, 3: info}

    async def main() -> None:
        async with Server(lambda n: answers[n]) as srv:

            async def calls(c: SGLangClient) -> None:
                with pytest.raises(EngineRejected) as missing:
                    await c.model_info()
                assert missing.value.status == 404
                assert await c.weight_version() == 3
                assert (await c.server_info())["weight_version"] == "3"

            await with_client(srv.url, calls)
            paths = [head.split(b" ")[1] for head in srv.heads]
            assert paths == [b"/model_info", b"/model_info", b"/server_info"], paths

    asyncio.run(main())


def test_the_served_version_is_read_only_as_sglangs_string() -> None:
    """/model_info's weight_version is a string in SGLang 0.5.23 (arg_groups/fields/serving.py
    172-175): "default" (no versioned update yet) names no version; a number is no SGLang answer."""
    bodies = {1: b'{"weight_version":"default"}', 2: b'{"weight_version":3}', 3: b"{}"}

    async def main() -> None:
        async with Server(lambda n: answer("200 OK", bodies[n])) as srv:

            async def calls(c: SGLangClient) -> None:
                assert await c.weight_version() is None
                for _ in range(2):
                    with pytest.raises(EngineUnavailable, match="not a string"):
                        await c.weight_version()

            await with_client(srv.url, calls)

    asyncio.run(main())


def test_framings_a_path_prefix_and_streaming() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    unframed = b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil close"
    error = answer("503 Service Unavailable", b'{"error":"x"}')

    async def main() -> None:
        async with Server(lambda n: chunked) as srv:
            r = await with_client(srv.url, lambda c: c.forward("POST", "/generate", b"{}"))
            assert r.content == b"abcde"

            async def streamed(c: SGLangClient) -> bytes:
                head, chunks = await c.stream_generate(b'{"stream":true}')
                assert head.status_code == 200 and head.content == b""
                return b"".join([x async for x in chunks])

            assert await with_client(srv.url, streamed) == b"abcde"
        async with Server(lambda n: unframed, close_after=True) as srv:
            r = await with_client(srv.url, lambda c: c.forward("POST", "/generate", b"{}"))
            assert r.content == b"until close" and r.headers["content-type"] == "text/plain"
        async with Server(lambda n: error) as srv:
            r = await with_client(srv.url + "/prefix", lambda c: c.forward("POST", "/generate", b"{}"))
            assert r.status_code == 503 and r.content == b'{"error":"x"}'
            assert srv.heads[0].startswith(b"POST /prefix/generate ")
            with pytest.raises(EngineUnavailable, match="HTTP 503: x"):
                await with_client(srv.url, lambda c: c.stream_generate(b"{}"))

    asyncio.run(main())


def test_connections_are_capped_and_requests_wait_for_one() -> None:
    async def main() -> None:
        async with Server(lambda n: ok(), delay=0.05) as srv:

            async def calls(c: SGLangClient) -> list:
                return await asyncio.gather(*(c.post_generate(b"{}") for _ in range(9)))

            answers = await with_client(srv.url, calls, max_connections=2)
        assert all(a.status_code == 200 for a in answers)
        assert srv.requests == 9 and srv.max_open <= 2

    asyncio.run(main())


# --- streamed generation -------------------------------------------------------------------------


def test_a_streamed_generate_answers_what_a_whole_one_does(engine: str) -> None:
    """The local engine streams cumulative bodies: every new id reaches ``on_tokens`` in order,
    more than one call, and the answer is the body a non-streamed request gets."""
    params = {"temperature": 0.8, "top_k": 20, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 5}
    calls: list[list[int]] = []

    async def on_tokens(ids: list[int]) -> None:
        calls.append(ids)

    whole = run(engine, lambda c: c.generate(PROMPT, params))
    streamed = run(engine, lambda c: c.generate(PROMPT, params, on_tokens=on_tokens))
    assert len(calls) > 1 and [t for ids in calls for t in ids] == whole.body["output_ids"]
    keep = ("output_token_logprobs", "output_token_sampling_mask", "output_token_sampling_logprobs")
    for body in (whole.body, streamed.body):
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert streamed.body["output_ids"] == whole.body["output_ids"]
    assert {k: streamed.body["meta_info"][k] for k in keep} == {k: whole.body["meta_info"][k] for k in keep}


FINAL = {
    "text": "",
    "output_ids": [7, 8, 9],
    "meta_info": {
        "completion_tokens": 3,
        "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None], [-0.3, 9, None]],
        "output_token_sampling_mask": [[7], [8, 1], [9]],
        "weight_version": "2",
        "finish_reason": {"type": "length", "length": 3},
    },
}


def _sse(final: dict, incremental: bool, upto: int | None = None) -> bytes:
    """SGLang's event stream of ``final``, one event per token (cumulative, or incremental), cut
    after ``upto`` events (no finish reason, no ``[DONE]``) when given."""
    meta, ids = final["meta_info"], final["output_ids"]
    events = []
    for k in range(1, len(ids) + 1):
        start = k - 1 if incremental else 0
        lists = {key: v[start:k] for key, v in meta.items() if key.startswith("output_token_")}
        m = {
            **meta,
            **lists,
            "completion_tokens": k,
            "finish_reason": meta["finish_reason"] if k == len(ids) else None,
        }
        events.append(
            b"data: " + json.dumps({"text": "", "output_ids": ids[start:k], "meta_info": m}).encode()
        )
    events = events[:upto] if upto is not None else [*events, b"data: [DONE]"]
    return b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + b"\n\n".join(events) + b"\n\n"


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_streamed_answer_is_the_final_chunk_made_whole(incremental: bool) -> None:
    calls: list[list[int]] = []

    async def on_tokens(ids: list[int]) -> None:
        calls.append(ids)

    async def main() -> None:
        async with Server(lambda n: _sse(FINAL, incremental), close_after=True) as srv:
            out = await with_client(
                srv.url, lambda c: c.generate(PROMPT, {"max_new_tokens": 3}, on_tokens=on_tokens)
            )
            assert json.loads(srv.bodies[0])["stream"] is True
        assert out.body == FINAL and calls == [[7], [8], [9]]

    asyncio.run(main())


def test_a_broken_or_refused_stream_is_classified() -> None:
    async def noop(ids: list[int]) -> None:
        pass

    refused = b'data: {"error": {"message": "bad input", "code": 400}}\n\ndata: [DONE]\n\n'
    refused_answer = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + refused

    async def main() -> None:
        gen = lambda c: c.generate(PROMPT, {"max_new_tokens": 3}, on_tokens=noop)  # noqa: E731
        async with Server(lambda n: _sse(FINAL, False, upto=2), close_after=True) as srv:
            with pytest.raises(EngineUnavailable, match="ended after 2 tokens without a finish reason"):
                await with_client(srv.url, gen)
        async with Server(lambda n: refused_answer, close_after=True) as srv:
            with pytest.raises(EngineRejected, match="bad input") as info:
                await with_client(srv.url, gen)
            assert info.value.status == 400
        async with Server(lambda n: answer("503 Service Unavailable", b'{"error":"x"}')) as srv:
            with pytest.raises(EngineUnavailable, match="HTTP 503: x"):
                await with_client(srv.url, gen)
        # SGLang's scheduler abort with a 400, streamed: its output (here the one token its stub
        # prefill drew) whose finish reason carries the status, then [DONE]
        # (managers/tokenizer_manager.py 1891-1922, 2041-2048): refused, no token passed on
        seen: list[list[int]] = []

        async def record(ids: list[int]) -> None:
            seen.append(ids)

        reason = {"type": "abort", "message": "req.logprob_start_len=9 is higher", "status_code": 400}
        event = {"text": "x", "output_ids": [5], "meta_info": {"finish_reason": {**reason, "err_type": "E"}}}
        aborted = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
        head = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
        async with Server(lambda n: head + aborted, close_after=True) as srv:
            recorded = lambda c: c.generate(PROMPT, {"max_new_tokens": 3}, on_tokens=record)  # noqa: E731
            with pytest.raises(EngineRejected, match="logprob_start_len=9 is higher") as info:
                await with_client(srv.url, recorded)
            assert info.value.status == 400 and seen == []

    asyncio.run(main())
