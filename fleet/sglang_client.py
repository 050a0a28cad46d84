"""One client for SGLang's native HTTP protocol (real SGLang servers, sidecars and the local
CPU engine alike), over one shared connection pool.

The pool is an ``aiohttp.ClientSession`` (:func:`make_http_client`, created inside the running
event loop): on the router's hot path it costs several times less CPU per request than
``httpx.AsyncClient`` (measured in ``benchmarks/router.py``'s development; httpx stays the
project's client everywhere else).

Errors are split by what a caller can do about them:

* :class:`EngineUnavailable` - connect error, timeout (the message then contains ``Timeout``),
  dropped connection or a 5xx: the request may be retried on another replica (nothing was
  produced that the caller has seen).
* :class:`EngineRejected` - a 4xx: the request itself is bad (or, with ``retryable``, a replica
  cannot meet a version constraint now: 409 from a sidecar); carries status and message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

try:  # orjson parses and writes engine bodies several times faster; json is the fallback
    import orjson
except ImportError:  # pragma: no cover
    orjson = None


class EngineError(Exception):
    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.message = message


class EngineUnavailable(EngineError):
    pass


class EngineRejected(EngineError):
    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(url, message)
        self.status = status
        self.retryable = status == 409


@dataclass(frozen=True)
class RawResponse:
    """A fully read response."""

    status_code: int
    content: bytes
    headers: dict[str, str]

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return loads(self.content)


def loads(content: bytes) -> Any:
    """Decode JSON bytes (orjson first; :mod:`json` for what only it accepts, e.g. ``NaN``)."""
    if orjson is not None:
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError:
            pass
    return json.loads(content)


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes for a request body (orjson when it can; else :mod:`json`)."""
    if orjson is not None:
        try:
            data = orjson.dumps(obj)
        except TypeError:
            pass
        else:
            if b"null" not in data:  # orjson writes NaN / inf as null; json keeps them
                return data
    return json.dumps(obj, separators=(",", ":")).encode()


def make_http_client(
    *, connect_timeout_s: float = 5.0, timeout_s: float = 600.0, max_connections: int = 1024
) -> aiohttp.ClientSession:
    """The shared pool: short connect timeout (a dead replica fails fast), long read timeout
    (generation takes as long as it takes). Idle connections are dropped after 2 s, before a
    server's keep-alive timeout (uvicorn: 5 s) can close them under a request in flight.
    Call inside a running event loop; close with ``await pool.close()``."""
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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return f"Timeout ({type(exc).__name__}) {exc}".strip()
    return f"{type(exc).__name__}: {exc}"


class SGLangClient:
    """Calls on one engine base URL. ``headers`` are sent with every request."""

    def __init__(
        self, http: aiohttp.ClientSession, base_url: str, headers: dict[str, str] | None = None
    ) -> None:
        self.http = http
        self.base_url = base_url.rstrip("/")
        self.headers = headers or {}

    def _json_headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        return {**self.headers, "content-type": "application/json", **(extra or {})}

    async def _send(self, call: Callable[[], Awaitable[RawResponse]], url: str) -> RawResponse:
        """One request; a pooled connection that the server closed under it (no response at
        all) is retried once on a fresh connection before the replica counts as failed."""
        for attempt in (0, 1):
            try:
                return await call()
            except aiohttp.ServerDisconnectedError as exc:
                if attempt == 0:
                    continue
                raise EngineUnavailable(url, _describe(exc)) from None
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise EngineUnavailable(url, _describe(exc)) from None
        raise AssertionError("unreachable")

    async def _fetch(
        self, method: str, url: str, *, data: bytes | None, headers: dict[str, str], timeout: float | None
    ) -> RawResponse:
        kwargs: dict[str, Any] = {"data": data, "headers": headers}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        async with self.http.request(method, url, **kwargs) as r:
            content = await r.read()
            return RawResponse(r.status, content, {k.lower(): v for k, v in r.headers.items()})

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> RawResponse:
        url = self.base_url + path
        data = None if json_body is None else dumps(json_body)
        hdrs = self._json_headers(headers) if data is not None else {**self.headers, **(headers or {})}
        response = await self._send(
            lambda: self._fetch(method, url, data=data, headers=hdrs, timeout=timeout), url
        )
        if response.status_code >= 500:
            raise EngineUnavailable(
                url, f"HTTP {response.status_code}: {error_message(response.status_code, response.content)}"
            )
        if response.status_code >= 400:
            raise EngineRejected(
                url, response.status_code, error_message(response.status_code, response.content)
            )
        return response

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        response = await self._request(method, path, **kw)
        try:
            return response.json()
        except ValueError:
            raise EngineUnavailable(self.base_url + path, "response is not JSON") from None

    async def generate(self, payload: dict[str, Any], *, headers: dict[str, str] | None = None) -> Any:
        """``POST /generate`` (non-streaming); returns the decoded JSON body."""
        return await self._json("POST", "/generate", json_body=payload, headers=headers)

    async def stream_generate(
        self, body: bytes, *, headers: dict[str, str] | None = None
    ) -> tuple[RawResponse, AsyncIterator[bytes]]:
        """Streaming ``POST /generate``: returns the response head (status, headers; empty
        content) once it arrived and an iterator over body chunks that releases the connection
        when exhausted or closed. Raises :class:`EngineUnavailable` before the first byte only."""
        url = self.base_url + "/generate"
        hdrs = self._json_headers(headers)

        async def start() -> Any:
            return await self.http.post(url, data=body, headers=hdrs)

        for attempt in (0, 1):
            try:
                r = await start()
                break
            except aiohttp.ServerDisconnectedError as exc:
                if attempt == 1:
                    raise EngineUnavailable(url, _describe(exc)) from None
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise EngineUnavailable(url, _describe(exc)) from None
        if r.status >= 500:
            content = await r.read()
            r.release()
            raise EngineUnavailable(url, f"HTTP {r.status}: {error_message(r.status, content)}")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.content.iter_any():
                    yield chunk
            finally:
                r.release()

        return RawResponse(r.status, b"", {k.lower(): v for k, v in r.headers.items()}), chunks()

    async def probe(self, timeout: float = 2.0) -> str:
        """``GET /health``: ``"ok"``, ``"unhealthy"`` (it answered, not 200), ``"unreachable"``
        (connection refused or dropped: likely dead) or ``"timeout"`` (likely just busy)."""
        url = self.base_url + "/health"
        try:
            r = await self._fetch("GET", url, data=None, headers=self.headers, timeout=timeout)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            return "timeout"
        except (aiohttp.ClientError, OSError):
            return "unreachable"
        return "ok" if r.status_code == 200 else "unhealthy"

    async def health(self, timeout: float = 2.0) -> bool:
        return await self.probe(timeout) == "ok"

    async def server_info(self, timeout: float = 5.0) -> dict[str, Any]:
        return await self._json("GET", "/server_info", timeout=timeout)

    async def model_info(self, timeout: float = 5.0) -> dict[str, Any]:
        return await self._json("GET", "/model_info", timeout=timeout)

    async def weight_version(self, timeout: float = 5.0) -> str | None:
        """The engine's active weight version as SGLang reports it (a string), or None."""
        for path in ("/server_info", "/get_weight_version", "/model_info"):
            try:
                data = await self._json("GET", path, timeout=timeout)
            except EngineRejected:
                continue
            if isinstance(data, dict) and data.get("weight_version") is not None:
                return str(data["weight_version"])
        return None


def parse_version(value: Any) -> int | None:
    """SGLang's string weight version -> int (None for 'default' and other non-integers)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None
