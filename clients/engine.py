"""The one client of an engine: SGLang's native HTTP protocol, which real SGLang servers, the
local CPU engine and the replica sidecars all speak, over one shared ``aiohttp`` pool.

Calls: :meth:`SGLangClient.generate` (the one engine request of a turn), the SGLang-native
passthrough (:meth:`~SGLangClient.post_generate`, :meth:`~SGLangClient.stream_generate`),
fixed-prefix scoring (:meth:`~SGLangClient.score`), the weight-update calls (pause, update
from disk, continue, cache flush, set the weight version; :mod:`replica.activation` is the protocol
that uses them), server and model info, health, metrics and the served weight
version. The pool (:func:`make_http_client`) is created inside the running event loop and shared
by every client of one process.

Errors are split by what a caller can do about them:

* :class:`EngineUnavailable` - connect error, timeout (the message then contains ``Timeout``),
  dropped connection, a 5xx or a body that is not the JSON the call expects: the request may be
  retried on another replica (nothing was produced that the caller has seen).
* :class:`EngineRejected` - a 4xx, or an engine that answered ``success: false``: the request
  itself is bad (or, with ``retryable``, this replica cannot take it now and another may: 409
  from a sidecar that cannot meet a version constraint, 429 from Modal's proxy for a container
  over its ``max_concurrency``); carries status and message.
* :class:`EngineAborted` (an :class:`EngineUnavailable`) - a generation the engine ended with
  finish reason ``abort`` and no error status (SGLang answers 200: ``/abort_request``, a pause in
  mode ``abort``, a weight update that aborts all requests, a server shutting down; an abort
  with a status of 400 or more is answered with that status, managers/tokenizer_manager.py
  1891-1922, and classified as above; streamed, the status rides in the last event's
  ``finish_reason``, read as that status before any of its ids reach ``on_tokens``,
  :mod:`clients.engine_stream`). Whatever it generated is discarded: the turn may be
  regenerated on another replica.

A pooled connection that the server closed under a request (no response byte at all) is retried
once on a fresh connection before the replica counts as unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from clients.engine_stream import StreamError, TokenCallback, streamed_answer
from core import sglang_release as release
from core.jsonio import Fragment, dumps, loads
from weight_sync.types import reported_version

__all__ = [
    "EngineAborted",
    "EngineError",
    "EngineRejected",
    "EngineUnavailable",
    "Generation",
    "RawResponse",
    "SGLangClient",
    "WeightsNotFlushed",
    "error_message",
    "make_http_client",
    "parse_prometheus",
    "reported_version",
]


class EngineError(Exception):
    """A call on the engine at ``url`` failed; ``message`` says how."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.message = message


class EngineUnavailable(EngineError):
    """No usable answer: the request may be retried on another replica."""


class EngineAborted(EngineUnavailable):
    """The engine aborted the generation (finish reason ``abort``, answered 200); ``message`` is
    its reason."""


RETRYABLE_STATUSES = (409, 429)
"""Statuses by which one replica refuses what another may take: a version conflict, a full container."""


class EngineRejected(EngineError):
    """The engine refused the request (``status``: its HTTP status); ``retryable`` for a status of
    :data:`RETRYABLE_STATUSES`."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(url, message)
        self.status = status
        self.retryable = status in RETRYABLE_STATUSES


class WeightsNotFlushed(EngineRejected):
    """An update the engine answered ``success: false`` only because its cache flush was refused
    (:data:`core.sglang_release.UPDATE_NOT_FLUSHED_PREFIX`): the new weights ARE served and the
    scheduler stamps the new version, but ``/model_info`` still names the old one."""


@dataclass(frozen=True)
class Generation:
    """A finished generation: the engine's decoded answer (an object whose finish reason is not
    ``abort``) and the :class:`~core.sglang_release.SamplingRequest` it answers (the
    ``sampling_params`` sent, whether a sampling mask was asked, the ``top_k`` bound)."""

    body: dict[str, Any]
    request: release.SamplingRequest
    routed_experts: bool = False  # return_routed_experts was asked ...
    routed_experts_start: int = 0  # ... from this position (routed_experts_start_len)

    @property
    def sampling(self) -> dict[str, Any] | None:
        """What the turn's record states about the sampling sent
        (:attr:`core.sglang_release.SamplingRequest.statement`)."""
        return self.request.statement


@dataclass(frozen=True)
class RawResponse:
    """A response as the engine sent it: status, body (empty for a stream's head) and headers
    with lower-cased names."""

    status_code: int
    content: bytes
    headers: dict[str, str]

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return loads(self.content)


def make_http_client(
    *, connect_timeout_s: float = 5.0, timeout_s: float = 600.0, max_connections: int = 1024
) -> aiohttp.ClientSession:
    """The shared pool: short connect timeout (a dead replica fails fast), long read timeout
    (no byte for ``timeout_s`` is a timeout; generation takes as long as it takes). Idle
    connections are dropped after 2 s, before a server's keep-alive timeout (uvicorn: 5 s) can
    close them under a request in flight. At most ``max_connections`` are open; further
    requests wait for one. Call inside a running event loop; close with ``await pool.close()``."""
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=2.0, ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s),
        trust_env=False,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


def error_message(status: int, content: bytes) -> str:
    """The message of an engine's error body (``error``/``detail``/``message``, or the text;
    ``HTTP <status>`` when empty), at most 500 characters."""
    try:
        body = loads(content)
    except ValueError:
        return content[:500].decode(errors="replace") or f"HTTP {status}"
    if isinstance(body, dict):
        err = body.get("error") or body.get("detail") or body.get("message") or body
        if isinstance(err, dict):
            err = err.get("message") or err
        body = err
    return str(body)[:500] or f"HTTP {status}"


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample per sample name in Prometheus text format (labels ignored; NaN
    samples skipped), parsed by :func:`prometheus_client.parser.text_string_to_metric_families`.
    Text that stops parsing yields the sums of the samples before the bad line."""
    out: dict[str, float] = {}
    with contextlib.suppress(ValueError):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return f"Timeout ({type(exc).__name__}) {exc}".strip()
    return f"{type(exc).__name__}: {exc}"


def _classify(url: str, response: RawResponse) -> RawResponse:
    """``response`` when below 400; else :class:`EngineUnavailable` (5xx) or
    :class:`EngineRejected` (4xx) with the body's message."""
    status = response.status_code
    if status < 400:
        return response
    message = error_message(status, response.content)
    if status >= 500:
        raise EngineUnavailable(url, f"HTTP {status}: {message}")
    raise EngineRejected(url, status, message)


async def _read_stream(url: str, chunks: AsyncGenerator[bytes, None], on_tokens: TokenCallback) -> Any:
    """:func:`~clients.engine_stream.streamed_answer` of a streamed ``/generate``, its failures
    classified as the module says; the connection is released however it ends."""
    try:
        return await streamed_answer(chunks, on_tokens)
    except StreamError as exc:
        if 400 <= exc.status < 500:
            raise EngineRejected(url, exc.status, exc.message) from None
        message = exc.message if exc.status == 0 else f"HTTP {exc.status}: {exc.message}"
        raise EngineUnavailable(url, message) from None
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise EngineUnavailable(url, _describe(exc)) from None
    finally:
        await chunks.aclose()


class SGLangClient:
    """Calls on the engine at ``base_url`` (a path prefix is kept); ``headers`` go with every
    request. Cheap to create: the connections belong to ``http``."""

    def __init__(
        self, http: aiohttp.ClientSession, base_url: str, headers: dict[str, str] | None = None
    ) -> None:
        self.http = http
        self.base_url = base_url.rstrip("/")
        self.headers = headers or {}

    # transport --------------------------------------------------------------------------------
    def _headers(self, body: bytes | None, extra: dict[str, str] | None) -> dict[str, str]:
        if body is None:
            return {**self.headers, **(extra or {})}
        return {**self.headers, "content-type": "application/json", **(extra or {})}

    async def _open(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], timeout: float | None
    ) -> aiohttp.ClientResponse:
        """The response head of one request (the caller reads and releases it)."""
        kwargs: dict[str, Any] = {"data": body, "headers": headers}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        for attempt in (0, 1):
            try:
                return await self.http.request(method, url, **kwargs)
            except aiohttp.ServerDisconnectedError as exc:
                if attempt == 0:
                    continue  # a pooled connection the server closed: resend once on a fresh one
                raise EngineUnavailable(url, _describe(exc)) from None
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                raise EngineUnavailable(url, _describe(exc)) from None
        raise AssertionError("unreachable")

    async def forward(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> RawResponse:
        """One request with ``body`` (sent as JSON) and the engine's whole answer, whatever its
        status. Raises :class:`EngineUnavailable` when no complete answer arrived."""
        url = self.base_url + path
        r = await self._open(method, url, body, self._headers(body, headers), timeout)
        try:
            content = await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(url, _describe(exc)) from None
        finally:
            r.release()
        return RawResponse(r.status, content, {k.lower(): v for k, v in r.headers.items()})

    async def stream(
        self, method: str, path: str, body: bytes | None = None, *, headers: dict[str, str] | None = None
    ) -> tuple[RawResponse, AsyncGenerator[bytes, None]]:
        """One request whose answer is read as it arrives: the response head (status, headers;
        empty content), whatever its status, and an iterator over body chunks that releases the
        connection when exhausted or closed. Raises :class:`EngineUnavailable` before the first
        byte only."""
        url = self.base_url + path
        r = await self._open(method, url, body, self._headers(body, headers), None)

        async def chunks() -> AsyncGenerator[bytes, None]:
            try:
                async for chunk in r.content.iter_any():
                    yield chunk
            finally:
                r.release()

        return RawResponse(r.status, b"", {k.lower(): v for k, v in r.headers.items()}), chunks()

    async def call(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """The decoded JSON answer of a call that must succeed (errors classified)."""
        body = None if payload is None else dumps(payload)
        url = self.base_url + path
        response = _classify(url, await self.forward(method, path, body, headers=headers, timeout=timeout))
        try:
            return response.json()
        except ValueError:
            raise EngineUnavailable(url, "response is not JSON") from None

    async def _info(self, path: str, timeout: float) -> dict[str, Any]:
        """``GET path``: its JSON object (raises as :meth:`call`, or :class:`EngineUnavailable`
        for another answer)."""
        data = await self.call("GET", path, timeout=timeout)
        if not isinstance(data, dict):
            raise EngineUnavailable(self.base_url + path, "response is not a JSON object")
        return data

    # generation ---------------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int] | Fragment,
        sampling_params: dict[str, Any],
        *,
        headers: dict[str, str] | None = None,
        sampling_mask_max_tokens: int = release.SAMPLING_MASK_MAX_TOKENS_DEFAULT,
        rid: str | None = None,
        routed_experts: bool = False,
        routed_experts_start: int = 0,
        on_tokens: TokenCallback | None = None,
    ) -> Generation:
        """``POST /generate`` of one sequence with its behavior records: the one engine request
        (``input_ids``, or their JSON text as a :data:`core.jsonio.Fragment`; ``return_logprob``;
        ``sampling_params`` and the sampling mask as
        :func:`core.sglang_release.sampling_request` decides for the engine's
        ``--sampling-mask-max-tokens``: ``return_sampling_mask`` with ``sampling_logprobs_mode:
        support``, so each token's support comes with its log-probs, unless the turn samples from
        the whole vocabulary, which is sent unchanged without a mask). ``rid`` names the request
        for :meth:`abort_request` (SGLang's ``GenerateReqInput.rid``, managers/io_struct.py 177-180;
        unique among the engine's running requests). ``routed_experts``: also
        ``return_routed_experts`` (positions from ``routed_experts_start``, sent as
        ``routed_experts_start_len`` when not 0; SGLang answers them only when started
        with ``--enable-return-routed-experts``, :mod:`core.sglang_release`). ``on_tokens``: the
        request is SGLang's streaming ``/generate`` (``"stream": true``) and ``await
        on_tokens(ids)`` gets each chunk's new output ids as it arrives; the answer is the final
        chunk, made whole (:func:`clients.engine_stream.streamed_answer`).

        Returns the :class:`Generation`. Raises :class:`EngineAborted` when the engine aborted
        the generation, :class:`EngineUnavailable` for an answer that is not a JSON object (or a
        stream that broke off or ended without a finish reason), :class:`EngineRejected` for a
        stream's error event with a 4xx code, and as :meth:`call` otherwise."""
        request = release.sampling_request(sampling_params, sampling_mask_max_tokens)
        payload: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": request.params,
            "return_logprob": True,
        }
        if rid is not None:
            payload["rid"] = rid
        if request.mask:
            payload["return_sampling_mask"] = True
            payload["sampling_logprobs_mode"] = release.SAMPLING_LOGPROBS_MODE
        if routed_experts:
            payload["return_routed_experts"] = True
            if routed_experts_start:
                payload["routed_experts_start_len"] = routed_experts_start
        url = self.base_url + "/generate"
        if on_tokens is None:
            data = await self.call("POST", "/generate", payload, headers=headers)
        else:
            payload["stream"] = True
            head, chunks = await self.stream_generate(dumps(payload), headers=headers)
            if head.status_code >= 400:
                _classify(url, RawResponse(head.status_code, b"".join([c async for c in chunks]), {}))
            data = await _read_stream(url, chunks, on_tokens)
        if not isinstance(data, dict):
            raise EngineUnavailable(url, "response is not a JSON object")
        meta = data.get("meta_info")
        finish = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise EngineAborted(
                url, f"the engine aborted the generation: {finish.get('message') or 'Aborted'}"
            )
        return Generation(data, request, routed_experts, routed_experts_start if routed_experts else 0)

    async def post_generate(self, body: bytes, *, headers: dict[str, str] | None = None) -> RawResponse:
        """SGLang-native ``POST /generate`` of ``body`` as given; the engine's answer, a 4xx
        (the request's own fault) included. Raises :class:`EngineUnavailable` without an answer
        or on a 5xx, and a retryable :class:`EngineRejected` on a status of
        :data:`RETRYABLE_STATUSES` (another replica may take it)."""
        url = self.base_url + "/generate"
        response = await self.forward("POST", "/generate", body, headers=headers)
        if response.status_code >= 500 or response.status_code in RETRYABLE_STATUSES:
            _classify(url, response)
        return response

    async def stream_generate(
        self, body: bytes, *, headers: dict[str, str] | None = None
    ) -> tuple[RawResponse, AsyncGenerator[bytes, None]]:
        """Streaming ``POST /generate`` of ``body`` as given (see :meth:`stream`); a 5xx head
        raises :class:`EngineUnavailable` and a head of :data:`RETRYABLE_STATUSES` a retryable
        :class:`EngineRejected`, before the first byte reached the caller."""
        head, chunks = await self.stream("POST", "/generate", body, headers=headers)
        if head.status_code >= 500 or head.status_code in RETRYABLE_STATUSES:
            content = b"".join([c async for c in chunks])
            _classify(self.base_url + "/generate", RawResponse(head.status_code, content, head.headers))
        return head, chunks

    async def abort_request(self, rid: str, *, timeout: float = 5.0) -> None:
        """``POST /abort_request {"rid": rid}``: the engine ends that request, if it still runs, with
        finish reason ``abort`` (entrypoints/http_server.py 1721-1731, body ``AbortReq`` of
        managers/io_struct.py 2285-2296; an unknown ``rid`` is ignored, tokenizer_manager.py
        2241-2253). Raises as :meth:`_call`."""
        url = self.base_url + "/abort_request"
        _classify(url, await self.forward("POST", "/abort_request", dumps({"rid": rid}), timeout=timeout))

    async def score(
        self, input_ids: Sequence[Sequence[int]], logprob_start_len: int, *, timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        """Log-probs of fixed sequences, nothing generated: per sequence the ``meta_info`` of the
        engine's answer (``input_token_logprobs`` from ``logprob_start_len`` on, ``weight_version``)."""
        payload = {
            "input_ids": [list(seq) for seq in input_ids],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": logprob_start_len,
        }
        data = await self.call("POST", "/generate", payload, timeout=timeout)
        items = data if isinstance(data, list) else [data]
        url = self.base_url + "/generate"
        if len(items) != len(input_ids) or not all(isinstance(i, dict) for i in items):
            raise EngineUnavailable(url, f"{len(items)} answers to {len(input_ids)} sequences")
        return [item.get("meta_info") or {} for item in items]

    # weights and control ------------------------------------------------------------------------
    async def pause_generation(self, mode: str = release.PAUSE_MODE, *, timeout: float = 60.0) -> None:
        """``POST /pause_generation``: ``retract`` (the fleet's, :data:`core.sglang_release.PAUSE_MODE`)
        moves running requests back to the waiting queue, to be recomputed on continue; ``in_place``
        holds them with their KV cache; ``abort`` aborts them."""
        await self.call("POST", "/pause_generation", {"mode": mode}, timeout=timeout)

    async def continue_generation(self, *, timeout: float = 60.0) -> None:
        """``POST /continue_generation`` (a no-op on an engine that is not paused)."""
        await self.call("POST", "/continue_generation", {}, timeout=timeout)

    async def update_weights_from_disk(self, request: dict[str, Any], *, timeout: float | None = None) -> str:
        """``POST /update_weights_from_disk`` of ``request`` (built by
        :func:`core.sglang_release.update_weights_request`); the engine's message once it took the
        weights and flushed its cache. Raises :class:`WeightsNotFlushed` when the engine swapped the
        weights but refused the flush (SGLang answers 400 ``success: false``; its ``/model_info``
        keeps the old version), else :class:`EngineRejected` for a refusal (the old weights keep
        serving) and as :meth:`call`. SGLang answers 200 only with ``success: true`` and a string
        ``message`` (entrypoints/http_server.py 1300-1326; managers/io_struct.py 1995-1999): any
        other 200 raises :class:`EngineUnavailable`."""
        url = self.base_url + "/update_weights_from_disk"
        try:
            data = await self.call("POST", "/update_weights_from_disk", request, timeout=timeout)
        except EngineRejected as exc:
            if release.UPDATE_NOT_FLUSHED_PREFIX in exc.message:
                raise WeightsNotFlushed(url, exc.status, exc.message) from None
            raise
        done = isinstance(data, dict) and data.get("success") is True
        if not (done and isinstance(data.get("message"), str)):
            raise EngineUnavailable(url, f"not SGLang's answer to an update: {str(data)[:300]}")
        return data["message"]

    async def update_weight_version(self, version: int, *, timeout: float = 60.0) -> None:
        """``POST /update_weight_version {new_version, abort_all_requests: false}``: the version the
        engine reports (``/model_info``) and stamps on new tokens, weights untouched
        (entrypoints/http_server.py 1527-1556; managers/io_struct.py 2155-2160, whose
        ``abort_all_requests`` defaults to true). SGLang answers 200 only with ``success: true`` and
        the version as sent (``new_version``, 1538-1547), a refusal 400 (1548-1556): any other 200
        raises :class:`EngineUnavailable`."""
        url = self.base_url + "/update_weight_version"
        payload = {"new_version": str(version), "abort_all_requests": False}
        data = await self.call("POST", "/update_weight_version", payload, timeout=timeout)
        done = isinstance(data, dict) and data.get("success") is True
        if not (done and data.get("new_version") == payload["new_version"]):
            raise EngineUnavailable(url, f"not SGLang's answer to a version update: {str(data)[:300]}")

    async def flush_cache(self, *, timeout: float = 60.0) -> None:
        """``POST /flush_cache``: drop the engine's prefix cache. Raises :class:`EngineRejected`
        (400) when the engine refuses: requests are running (or waiting, unless it is paused in
        ``retract`` or ``in_place`` mode; managers/scheduler.py 5518-5548)."""
        url = self.base_url + "/flush_cache"
        _classify(url, await self.forward("POST", "/flush_cache", timeout=timeout))

    # info, health, metrics ----------------------------------------------------------------------
    async def server_info(self, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /server_info`` (entrypoints/http_server.py 863-890; SGLang 0.5.23 serves it,
        ``/get_server_info`` being its deprecated alias, 853-860)."""
        return await self._info("/server_info", timeout)

    async def model_info(self, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /model_info`` (entrypoints/http_server.py 812-850; ``/get_model_info`` is its
        deprecated alias, 802-809)."""
        return await self._info("/model_info", timeout)

    async def weight_version(self, timeout: float = 5.0) -> int | None:
        """The version the engine serves, from its model info's ``weight_version``, always a
        string in SGLang 0.5.23 (arg_groups/fields/serving.py 172-175, entrypoints/http_server.py
        824-826); None for a string that names no integer (SGLang's ``"default"`` before any
        versioned update). Raises :class:`EngineUnavailable` for any other value."""
        info = await self.model_info(timeout)
        named = info.get("weight_version")
        if not isinstance(named, str):
            raise EngineUnavailable(self.base_url + "/model_info", f"weight_version {named!r}: not a string")
        return reported_version(info)

    async def probe(self, timeout: float = 2.0) -> str:
        """``GET /health``: ``"ok"``, ``"unhealthy"`` (it answered, not 200), ``"unreachable"``
        (connection refused or dropped: likely dead) or ``"timeout"`` (likely just busy)."""
        try:
            r = await self.forward("GET", "/health", timeout=timeout)
        except EngineUnavailable as exc:
            return "timeout" if "Timeout" in exc.message else "unreachable"
        return "ok" if r.status_code == 200 else "unhealthy"

    async def health(self, timeout: float = 2.0) -> bool:
        """Whether ``GET /health`` answers 200."""
        return await self.probe(timeout) == "ok"

    async def metrics(self, timeout: float = 5.0) -> str:
        """``GET /metrics``: the engine's Prometheus text."""
        url = self.base_url + "/metrics"
        return _classify(url, await self.forward("GET", "/metrics", timeout=timeout)).text
