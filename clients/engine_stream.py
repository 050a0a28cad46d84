"""Reading SGLang's streaming ``/generate`` answer (:meth:`clients.engine.SGLangClient.generate`
with ``on_tokens``): server-sent events ``data: <json>`` (SGLang 0.5.23 entrypoints/http_server.py
956) ending with ``data: [DONE]`` (975); an error inside the stream is one ``data: {"error":
{"message", "code", ...}}`` event (958-974, ``code`` at 969). A request the scheduler aborts
with an error status (a 400: the sampling-mask rule, a ``logprob_start_len`` past the input, ...)
is no error event: its output, whose ``finish_reason`` is the abort with that ``status_code``, is
one event before ``[DONE]`` (managers/tokenizer_manager.py 1891-1922, 2041-2048), carrying the id
its one-token stub prefill drew where ``set_finish_with_abort`` aborted it (managers/
schedule_batch.py 2221-2238; scheduler_components/batch_result_processor.py 363-369), read here
as that status (:func:`core.sglang_release.abort_status`) before that id reaches the caller, so
the request is refused, not taken for an engine that aborted it (which answers an abort without
a status, and may be retried).

Each chunk is the generation so far, cumulative by default: ``output_ids`` and the per-token
``meta_info`` lists grow (managers/tokenizer_manager.py 2650-2664). A server started with
``--incremental-streaming-output`` sends only each chunk's new ids and its per-token ``meta_info``
lists (:data:`INCREMENTAL_KEYS`) sliced alike (2629-2649, 364-374); its other fields
(``finish_reason``, ``weight_versions``, ``routed_experts``, counts) are whole.
:func:`streamed_answer` tells the two apart per chunk: a chunk whose ``output_ids`` extend the ids
seen so far, as many as its ``meta_info.completion_tokens`` (the count of every token generated,
in either mode: 2556) when given, is cumulative; any other carries only new ids. The answer is the
final chunk (the one with a ``finish_reason``), made whole in the incremental case (ids and
per-token lists joined), so it is exactly the object a non-streamed request answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from core.jsonio import loads
from core.sglang_release import abort_status

TokenCallback = Callable[[list[int]], Awaitable[None]]
"""Called with the new output ids of each chunk that has some, in order."""

INCREMENTAL_KEYS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
)
"""Per-token ``meta_info`` lists an incremental stream slices: SGLang's
(managers/tokenizer_manager.py 258-264)."""


class StreamError(Exception):
    """The stream failed: ``status`` is an error event's ``code`` (a 4xx: the request's fault),
    or 0 for a stream that broke off or is not SGLang's (the request may be retried elsewhere)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def streamed_answer(chunks: AsyncIterator[bytes], on_tokens: TokenCallback) -> dict[str, Any]:
    """The final chunk of the event stream read from ``chunks`` (the raw body), made whole
    (module docstring), after ``on_tokens`` got every new id. Raises :class:`StreamError`."""
    merged = _Merged()
    buffer = bytearray()
    async for piece in chunks:
        scan = max(len(buffer) - 1, 0)  # an event's end may straddle two pieces
        buffer += piece
        while (end := buffer.find(b"\n\n", scan)) >= 0:
            data = _data(bytes(buffer[:end]))
            del buffer[: end + 2]
            scan = 0
            if not data or data == b"[DONE]":
                continue
            new = merged.add(_chunk(data))
            if new:
                await on_tokens(new)
            if merged.final is not None:
                return merged.final
    raise StreamError(0, f"the stream ended after {len(merged.ids)} tokens without a finish reason")


def _data(event: bytes) -> bytes:
    """The ``data:`` lines of one event, joined."""
    return b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))


def _chunk(data: bytes) -> dict[str, Any]:
    """One event's object; an error event raised as :class:`StreamError`."""
    try:
        obj = loads(data)
    except ValueError:
        raise StreamError(0, f"a stream event is not JSON: {data[:200]!r}") from None
    if type(obj) is not dict:
        raise StreamError(0, "a stream event is not a JSON object")
    error = obj.get("error")
    if error is not None:
        code = error.get("code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        raise StreamError(code if type(code) is int and 400 <= code < 600 else 0, str(message)[:500])
    ids, meta = obj.get("output_ids"), obj.get("meta_info")
    if type(ids) is not list or type(meta) is not dict:
        raise StreamError(0, "a stream event has no output_ids list or meta_info object")
    status = abort_status(meta.get("finish_reason"))
    if status is not None:  # the scheduler's refusal, before any of its ids reach the caller
        message = meta["finish_reason"].get("message")
        raise StreamError(status, str(message or "Aborted")[:500])
    return obj


class _Merged:
    """The ids seen so far, the per-token lists (copied once the stream proved incremental), the
    final answer."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.lists: dict[str, list[Any]] = {}
        self.incremental = False
        self.final: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> list[int]:
        """Take one chunk; its new ids."""
        ids, meta = chunk["output_ids"], chunk["meta_info"]
        seen = len(self.ids)
        count = meta.get("completion_tokens")
        lists = {k: meta[k] for k in INCREMENTAL_KEYS if type(meta.get(k)) is list}
        if not self.incremental and ids[:seen] == self.ids and (type(count) is not int or count == len(ids)):
            new = ids[seen:]
            self.ids, self.lists = ids, lists  # the chunk's own, whole so far
        else:
            if not self.incremental:
                self.incremental = True
                self.ids, self.lists = list(self.ids), {k: list(v) for k, v in self.lists.items()}
            new = list(ids)
            self.ids.extend(ids)
            for key, values in lists.items():
                self.lists.setdefault(key, []).extend(values)
        if meta.get("finish_reason") is not None:
            self.final = self._whole(chunk) if self.incremental else chunk
        return new

    def _whole(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The final chunk of an incremental stream with every id and per-token list."""
        meta = {**chunk["meta_info"], **self.lists}
        return {**chunk, "output_ids": self.ids, "meta_info": meta}
