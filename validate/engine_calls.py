"""The replica requests validation makes, synchronously, through the one engine client
(``clients.engine.SGLangClient``, and ``clients.sidecar`` over it): sampling continuations, routed
experts of fixed sequences, a sidecar's status, and the local engine's one-operator debug route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from clients.engine import EngineError, SGLangClient, make_http_client
from core import sglang_release as release

T = TypeVar("T")


def _run(url: str, fn: Callable[[SGLangClient], Awaitable[T]]) -> T:
    async def go() -> T:
        http = make_http_client(timeout_s=300.0)
        try:
            return await fn(SGLangClient(http, url))
        finally:
            await http.close()

    return asyncio.run(go())


@dataclass(frozen=True)
class Sample:
    """A continuation the group sampled: its tokens and the log-probs the engine reported while
    decoding them (through its KV cache, one token at a time)."""

    tokens: tuple[int, ...]
    decode_logp: tuple[float, ...]


def sample(url: str, prompts: Sequence[Sequence[int]], max_new: int, top_p: float) -> list[Sample]:
    """One continuation per prompt from the replica at ``url`` (temperature 1, ``top_p``), one request
    at a time: each is decoded alone, so level 5's decode-versus-prefill comparison measures the KV
    cache's history and not which other requests shared a batch."""

    async def go(c: SGLangClient) -> list[Sample]:
        params = {"max_new_tokens": max_new, "temperature": 1.0, "top_p": top_p, "ignore_eos": True}
        gens = [await c.generate(list(p), params) for p in prompts]
        out = []
        for g in gens:
            rows = g.body["meta_info"].get("output_token_logprobs") or []
            out.append(Sample(tuple(int(r[1]) for r in rows), tuple(float(r[0]) for r in rows)))
        return out

    return _run(url, go)


def sidecar_status(url: str) -> dict[str, Any] | None:
    """The sidecar's ``/v1/status`` at ``url`` (``clients.sidecar``); None when it does not answer."""
    from clients.sidecar import SidecarClient

    async def go(c: SGLangClient) -> dict[str, Any]:
        return await SidecarClient(c).status(timeout=10.0)

    try:
        return _run(url, go)
    except EngineError:
        return None


def routed_experts(url: str, seqs: Sequence[Sequence[int]], layers: int, k: int) -> list[torch.Tensor] | None:
    """Per sequence the engine's top-k expert ids ``[len - 1, layers, k]`` (SGLang 0.5.23's
    ``return_routed_experts``, ``core.sglang_release``); None when the engine returns none (it runs
    without ``--enable-return-routed-experts``)."""

    async def go(c: SGLangClient) -> list[torch.Tensor] | None:
        out = []
        for s in seqs:
            body = {
                "input_ids": list(s),
                "sampling_params": {"max_new_tokens": 0},
                "return_routed_experts": True,
                "routed_experts_start_len": 0,
            }
            r = await c.post_generate(json.dumps(body).encode())
            if r.status_code != 200:
                raise EngineError(url, f"routed experts: {r.status_code} {r.text[:200]}")
            text = (r.json().get("meta_info") or {}).get(release.META_ROUTED_EXPERTS)
            if text is None:
                return None
            flat = torch.tensor(release.decode_routed_experts(text), dtype=torch.int64)
            out.append(flat.reshape(len(s) - 1, layers, k))
        return out

    return _run(url, go)


def operator(engine_url: str, name: str, x: torch.Tensor) -> torch.Tensor | None:
    """The engine's output of linear ``name`` on ``x`` (``POST /debug/operator``, the local engine's
    debug route); None when the engine has no such route (SGLang)."""

    async def go(c: SGLangClient) -> Any:
        body = json.dumps({"name": name, "input": x.tolist()}).encode()
        return await c.forward("POST", "/debug/operator", body)

    r = _run(engine_url, go)
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise EngineError(engine_url, f"/debug/operator {name}: {r.status_code} {r.text[:300]}")
    return torch.tensor(r.json()["output"], dtype=torch.float32)
