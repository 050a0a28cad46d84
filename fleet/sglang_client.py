"""One client for SGLang's native HTTP protocol (real SGLang servers, sidecars and the local
CPU engine alike), over a shared ``httpx.AsyncClient``.

Errors are split by what a caller can do about them:

* :class:`EngineUnavailable` - connect error, timeout, dropped connection or a 5xx: the request
  may be retried on another replica (nothing was produced that the caller has seen).
* :class:`EngineRejected` - a 4xx: the request itself is bad (or, with ``retryable``, a replica
  cannot meet a version constraint now: 409 from a sidecar); carries status and message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


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


def make_http_client(
    *, connect_timeout_s: float = 2.0, timeout_s: float = 600.0, max_connections: int = 1024
) -> httpx.AsyncClient:
    """The shared pool: short connect timeout (a dead replica fails fast), long read timeout
    (generation takes as long as it takes)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
        # idle connections are dropped before a server's keep-alive timeout (uvicorn: 5 s) can
        # close them under a request in flight
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=2.0
        ),
        trust_env=False,
    )


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error") or body.get("detail") or body.get("message") or body
        if isinstance(err, dict):
            err = err.get("message") or err
        return str(err)[:500]
    return str(body)[:500]


class SGLangClient:
    """Calls on one engine base URL. ``headers`` are sent with every request."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.http = http
        self.base_url = base_url.rstrip("/")
        self.headers = headers or {}

    def _json_headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        return {**self.headers, "content-type": "application/json", **(extra or {})}

    async def _send(self, call, url: str) -> httpx.Response:
        """One request; a pooled connection that the server closed under it (no response at
        all) is retried once on a fresh connection before the replica counts as failed."""
        for attempt in (0, 1):
            try:
                return await call()
            except httpx.RemoteProtocolError as exc:
                if attempt == 0:
                    continue
                raise EngineUnavailable(url, f"{type(exc).__name__}: {exc}") from None
            except httpx.HTTPError as exc:
                raise EngineUnavailable(url, f"{type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        url = self.base_url + path
        kwargs: dict[str, Any] = {"headers": {**self.headers, **(headers or {})}}
        if json_body is not None:
            kwargs["content"] = json.dumps(json_body, separators=(",", ":"))
            kwargs["headers"]["content-type"] = "application/json"
        if timeout is not None:
            kwargs["timeout"] = timeout
        response = await self._send(lambda: self.http.request(method, url, **kwargs), url)
        if response.status_code >= 500:
            raise EngineUnavailable(url, f"HTTP {response.status_code}: {_error_message(response)}")
        if response.status_code >= 400:
            raise EngineRejected(url, response.status_code, _error_message(response))
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

    async def generate_raw(self, body: bytes, *, headers: dict[str, str] | None = None) -> httpx.Response:
        """``POST /generate`` with a body passed through unchanged; the response as received."""
        url = self.base_url + "/generate"
        response = await self._send(
            lambda: self.http.post(url, content=body, headers=self._json_headers(headers)), url
        )
        if response.status_code >= 500:
            raise EngineUnavailable(url, f"HTTP {response.status_code}: {_error_message(response)}")
        return response

    async def stream_generate(
        self, body: bytes, *, headers: dict[str, str] | None = None
    ) -> tuple[httpx.Response, AsyncIterator[bytes]]:
        """Streaming ``POST /generate``: returns the response (status, headers) once its head
        arrived and an iterator over body chunks that closes the response when exhausted.
        Raises :class:`EngineUnavailable` before the first byte only."""
        url = self.base_url + "/generate"
        request = self.http.build_request("POST", url, content=body, headers=self._json_headers(headers))
        response = await self._send(lambda: self.http.send(request, stream=True), url)
        if response.status_code >= 500:
            await response.aread()
            await response.aclose()
            raise EngineUnavailable(url, f"HTTP {response.status_code}: {_error_message(response)}")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return response, chunks()

    async def probe(self, timeout: float = 2.0) -> str:
        """``GET /health``: ``"ok"``, ``"unhealthy"`` (it answered, not 200), ``"unreachable"``
        (connection refused or dropped: likely dead) or ``"timeout"`` (likely just busy)."""
        try:
            response = await self.http.get(self.base_url + "/health", headers=self.headers, timeout=timeout)
        except httpx.TimeoutException:
            return "timeout"
        except httpx.HTTPError:
            return "unreachable"
        return "ok" if response.status_code == 200 else "unhealthy"

    async def health(self, timeout: float = 2.0) -> bool:
        try:
            await self._request("GET", "/health", timeout=timeout)
            return True
        except EngineError:
            return False

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
