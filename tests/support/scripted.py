"""A scripted SGLang-protocol engine (the chat tests' tool calls, a router test's slow turns): a
loopback proxy in front of a real local engine that records every ``/generate`` exchange and,
while a script is queued, answers the next one with the scripted output ids.

A scripted answer is the real engine's answer to the same request asked for exactly as many
tokens (``ignore_eos``, no stop ids) with the sampled ids replaced by the script: every field the
router reads keeps the engine's shape (the log-probs are those of the tokens the engine drew, not
of the script's); its finish reason is ``stop`` on the script's last id when that is one of the
request's stop ids, else ``length``. Only turns without a sampling mask (temperature > 0,
``top_p`` 1) are scripted. Everything else passes through unchanged. ``delay_s`` holds every
``/generate`` answer back that long (a turn still running when a retry comes).

A streaming ``/generate`` (``"stream": true``) is asked of the real engine whole, then sent as
SGLang streams it: one ``data:`` event per token, ``token_delay_s`` apart, cumulative (every
chunk the generation so far, the per-token ``meta_info`` lists cut to it, ``finish_reason`` only on
the last) or, with ``incremental``, each chunk's new id and list entries only
(``--incremental-streaming-output``), then ``data: [DONE]``. ``fail_after``: each streamed answer
takes its first entry, if any, and breaks off after that many token events instead (the connection
dropped mid-answer; engines may share one list). ``finished_at``: when the last token event was
about to be sent (``time.monotonic``). ``rids``: the ``rid`` of every ``/generate``
and of every ``/abort_request``, in order, as ``(path, rid)``. ``asked``: the ``sampling_params`` of
every ``/generate`` as the router sent them (before a script replaces the length), in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from tests.support.recorder import HOP, serving


@dataclass
class ScriptedEngine:
    """``script``: queued output ids, one list per turn; ``generated``: ``(input_ids, output_ids)``
    of every ``/generate`` answered, in order; ``delay_s``: module docstring."""

    upstream: str
    url: str = ""
    script: list[list[int]] = field(default_factory=list)
    generated: list[tuple[list[int], list[int]]] = field(default_factory=list)
    delay_s: float = 0.0
    token_delay_s: float = 0.0
    incremental: bool = False
    fail_after: list[int] = field(default_factory=list)
    finished_at: float = 0.0
    rids: list[tuple[str, str | None]] = field(default_factory=list)
    asked: list[dict] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        script = self.script.pop(0) if request.path == "/generate" and self.script else None
        sent = body
        req = json.loads(body) if request.path in ("/generate", "/abort_request") else {}
        if req:
            self.rids.append((request.path, req.get("rid")))
        if request.path == "/generate":
            self.asked.append(dict(req.get("sampling_params") or {}))
        stream = bool(req.pop("stream", False))
        if script is not None:
            params = dict(req["sampling_params"])
            stops = set(params.pop("stop_token_ids", ()) or ())
            params.update(max_new_tokens=len(script), ignore_eos=True)
            req["sampling_params"] = params
        if script is not None or stream:
            sent = json.dumps(req).encode()
        async with (
            aiohttp.ClientSession() as http,
            http.request(request.method, self.upstream + request.path_qs, data=sent, headers=headers) as r,
        ):
            answer = await r.read()
            status, ctype = r.status, r.content_type
        if request.path == "/generate" and status == 200:
            await asyncio.sleep(self.delay_s)
            out = json.loads(answer)
            if script is not None:
                out = _scripted(out, script, stops)
                answer = json.dumps(out).encode()
            self.generated.append((json.loads(body)["input_ids"], out["output_ids"]))
            if stream:
                return await self._stream(request, out)
        return web.Response(status=status, body=answer, content_type=ctype)

    async def _stream(self, request: web.Request, out: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        ids, meta = out["output_ids"], out["meta_info"]
        lists = {k: v for k, v in meta.items() if k.startswith("output_token_") and isinstance(v, list)}
        fail_after = self.fail_after.pop(0) if self.fail_after else None
        for k in range(1, max(len(ids), 1) + 1):
            if fail_after is not None and k > fail_after:
                request.transport.close()  # the connection drops mid-answer
                return response
            start = k - 1 if self.incremental else 0
            chunk_meta = {**meta, **{key: v[start:k] for key, v in lists.items()}, "completion_tokens": k}
            if k < len(ids):
                chunk_meta["finish_reason"] = None
            chunk = {"text": "", "output_ids": ids[start:k], "meta_info": chunk_meta}
            if k >= len(ids):  # set before the write: the router may answer its client at once
                self.finished_at = time.monotonic()
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if k < len(ids):
                await asyncio.sleep(self.token_delay_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _scripted(out: dict, script: list[int], stops: set[int]) -> dict:
    meta = dict(out["meta_info"])
    assert len(out["output_ids"]) == len(script), "the engine did not generate the scripted length"
    meta["output_token_logprobs"] = [
        [lp, tok, None] for (lp, _t, _x), tok in zip(meta["output_token_logprobs"], script, strict=True)
    ]
    last = script[-1]
    meta["finish_reason"] = (
        {"type": "stop", "matched": last} if last in stops else {"type": "length", "length": len(script)}
    )
    return {**out, "output_ids": list(script), "meta_info": meta}


@contextlib.contextmanager
def scripted_engine(upstream: str) -> Iterator[ScriptedEngine]:
    """Serve a :class:`ScriptedEngine` in front of ``upstream`` until the block ends."""
    with serving(ScriptedEngine(upstream), "scripted-engine") as engine:
        yield engine
