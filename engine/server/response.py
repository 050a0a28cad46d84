"""One ``/generate`` item's answer in SGLang's shape, built from the scheduler's events.

:class:`GenerateResponse` accumulates :class:`~engine.runtime.scheduler.TokenEvent`,
``PrefillEvent`` and ``FinishEvent`` and renders ``{"text", "output_ids", "meta_info"}``; the
``meta_info`` fields are listed in :mod:`engine.server.app`. Its keys come in the order SGLang
0.5.23's tokenizer manager writes them (managers/tokenizer_manager.py 2506-2617, 2750-2775,
2024-2029), as a server started as the fleet starts SGLang (``--enable-metrics``,
``images/sglang.py``) answers them: what only a finished output carries (``weight_versions``,
``e2e_latency``, the request's timings) is absent from a stream's earlier chunks.
"""

from __future__ import annotations

import time
from typing import Any

from core.sglang_release import FORCE_STREAM_INTERVAL, META_ROUTED_EXPERTS, encode_routed_experts
from engine.runtime.engine import Engine
from engine.runtime.sampler import finite_or_none
from engine.runtime.scheduler import FinishEvent, PrefillEvent, TokenEvent


class GenerateResponse:
    """Accumulates one request's events into SGLang's response shape."""

    def __init__(self, engine: Engine, spec: Any, start: float) -> None:
        self.engine = engine
        self.spec = spec
        self.start = start
        self.output_ids: list[int] = []
        self.draws: list[Any] = []
        self.versions: list[int] = []
        self.prefill: Any = None
        self.finish: Any = None
        self.retractions = 0
        self.clock = _Clock(start)
        skip = spec.skip_special_tokens
        self.detokenizer = _Detokenizer(spec.detokenize_context, lambda ids: engine.decode(ids, skip))
        self.detokenized = 0  # output ids the detokenizer has taken

    def add(self, event: Any) -> None:
        self.clock.saw(event)
        if isinstance(event, TokenEvent):
            self.output_ids.append(event.draw.token_id)
            self.draws.append(event.draw)
            self.versions.append(event.weight_version)
            self.retractions = event.retractions
            if not event.finishes and streamer_sends(self.spec, len(self.output_ids)):
                self._detokenize(finished=False)
        elif isinstance(event, PrefillEvent):
            self.prefill = event
        elif isinstance(event, FinishEvent):
            self.finish = event
            self.retractions = event.retractions
            if not event.echo:  # an echo carries nothing the output streamer had not sent
                self._detokenize(finished=True)

    def _detokenize(self, finished: bool) -> None:
        """Hand the output ids since the last output to :attr:`detokenizer`, as SGLang's output
        streamer sends them (its finish: the one with a finish reason)."""
        new = self.output_ids[self.detokenized :]
        self.detokenized = len(self.output_ids)
        self.detokenizer.step(new, finished, finished and self._trims_matched_stop())

    def spans(self) -> list[dict[str, Any]]:
        """``meta_info.weight_versions``: the output's spans by the version that drew each token,
        each version a string (SGLang 0.5.23's ``WeightVersionSpan.version: str``,
        utils/weight_versions.py 17-20, 90-106); with no output, one empty span of the current
        version (``compute_weight_version_spans``, 66-84)."""
        if not self.versions:
            v = self.finish.weight_version if self.finish is not None else self.engine.weight_version
            return [{"version": str(v), "start": 0, "end": 0}]
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(map(str, self.versions)):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        return spans

    def _logged_draws(self) -> list[Any]:
        """The draws whose output log-probs the answer lists: none for a request the scheduler
        aborted when it took it (``spec.to_finish``), whose ``Req.return_logprob`` SGLang turned
        off (managers/schedule_batch.py 2233-2236), so its output streamer sends empty lists
        (scheduler_components/output_streamer.py 647-653) under the keys the client asked for
        (managers/tokenizer_manager.py 2520-2529, 2868-2870); else every draw."""
        return [] if self.spec.to_finish is not None else self.draws

    def _trims_matched_stop(self) -> bool:
        """Whether the text drops the output's last id: SGLang's detokenizer drops it where a
        stop id or EOS finished the output (a ``matched`` id), unless ``no_stop_trim``
        (managers/detokenizer_manager.py ``trim_matched_stop`` 194-226, applied 346-351).
        ``output_ids`` keep it (scheduler_components/output_streamer.py 490-491)."""
        matched = self.finish.finish_reason.get("matched")
        return isinstance(matched, int) and not isinstance(matched, bool) and not self.spec.no_stop_trim

    def _text(self, token_id: int) -> str | None:
        return self.engine.decode([token_id], False) if self.spec.return_text_in_logprobs else None

    def _logprob_meta(self, sent: int | None = None) -> dict[str, Any]:
        """The log-prob keys of an answer that asked ``return_logprob`` (managers/
        tokenizer_manager.py 2520-2529, 2840-3007); ``sent``: only the first ``sent`` output
        tokens', and the input's once an output was sent (an abort echo's, :meth:`_echo_body`)."""
        f = finite_or_none
        spec = self.spec
        meta: dict[str, Any] = {}
        pre = self.prefill if sent is None or sent > 0 else None
        logged = self._logged_draws()[:sent]
        meta["input_token_logprobs"] = (
            [[None if lp is None else f(lp), t, self._text(t)] for lp, t in pre.input_token_logprobs]
            if pre is not None
            else []
        )
        meta["output_token_logprobs"] = [[f(d.logprob), d.token_id, self._text(d.token_id)] for d in logged]
        # every answer with log-probs counts them (managers/tokenizer_manager.py 2868-2870)
        meta["output_token_logprobs_length"] = len(logged)
        if spec.top_logprobs_num > 0:
            meta["input_top_logprobs"] = (
                [
                    None if top is None else [[f(lp), t, self._text(t)] for lp, t in top]
                    for top in pre.input_top_logprobs
                ]
                if pre is not None
                else []
            )
            meta["output_top_logprobs"] = [
                [[f(lp), t, self._text(t)] for lp, t in d.top_logprobs] for d in logged
            ]
        return meta

    def _mask_meta(self) -> dict[str, Any]:
        """The sampling-mask keys of an answer that asked ``return_sampling_mask``
        (tokenizer_manager.py 2531-2551): per token the support ranked as SGLang's sampler packs
        it, highest weight first (layers/sampler.py 607-616: ``torch.topk(..., sorted=True)``,
        or the PyTorch producer's descending sort, 821, 850-857), and in support mode its
        log-probs aligned with it (618-624; sampling/sampling_mask.py 37-51), else mu per token."""
        f = finite_or_none
        ranked = [d.ranked_support() for d in self.draws]
        meta: dict[str, Any] = {"output_token_sampling_mask": [list(ids) for ids, _ in ranked]}
        if self.spec.sampling_logprobs_mode == "support":
            meta["output_token_sampling_logprobs"] = [[f(x) for x in lps] for _, lps in ranked]
        else:
            meta["output_token_sampling_logprobs"] = [f(d.sampling_logprob) for d in self.draws]
        meta["output_token_sampling_mask_length"] = len(self.draws)
        return meta

    def _echo_body(self) -> dict[str, Any]:
        """The answer to an abort SGLang 0.5.23's scheduler echoes (:attr:`FinishEvent.echo`), as
        its tokenizer manager writes it (``_handle_abort_req``, managers/tokenizer_manager.py
        3577-3642) from what it was sent (:attr:`detokenized` ids, their text and log-probs):
        ``id``, ``finish_reason``, ``weight_version``, ``e2e_latency``, the spans cut to the ids
        sent (``add_weight_versions_to_meta_info``, utils/weight_versions.py 90-107, which sets
        ``weight_version`` to the last one's), the log-prob keys when asked, ``completion_tokens``
        (the ids sent); then ``response_sent_to_client_ts`` where nothing was sent before
        (2019-2029). No ``prompt_tokens``, timings, masks, ``cached_tokens_details`` or
        ``dp_rank``."""
        sent = self.detokenized
        visible = [s for s in self.spans() if s["start"] < sent or s["start"] == 0]
        spans = [{**s, "end": min(s["end"], sent)} for s in visible]
        meta: dict[str, Any] = {
            "id": self.spec.rid,
            "finish_reason": self.finish.finish_reason,
            "weight_version": spans[-1]["version"],
            "e2e_latency": self.clock.e2e_latency(),
            "weight_versions": spans,
        }
        if self.spec.return_logprob:
            meta.update(self._logprob_meta(sent))
        meta["completion_tokens"] = sent
        meta.update(self.clock.sent())
        return {"text": self.detokenizer.text, "output_ids": self.output_ids[:sent], "meta_info": meta}

    def body(self) -> dict[str, Any]:
        """The answer as SGLang sends it now: the final one once the finish was added (an abort
        echo's: :meth:`_echo_body`), else a stream's chunk (which :attr:`clock` counts as sent),
        sent where :func:`streamer_sends`."""
        if self.finish is not None and self.finish.echo:
            return self._echo_body()
        spec = self.spec
        finished = self.finish is not None
        meta: dict[str, Any] = {  # managers/tokenizer_manager.py 2507-2513
            "id": spec.rid,
            "finish_reason": self.finish.finish_reason if finished else None,
            "prompt_tokens": len(spec.input_ids),
            # the tokenizer manager's version; a finished output's spans replace it (2560-2569)
            "weight_version": str(self.engine.reported_version),
            "num_retractions": self.retractions,
            **self.clock.scheduler_times(),
        }
        if spec.return_logprob:
            meta.update(self._logprob_meta())
        if spec.return_sampling_mask:
            meta.update(self._mask_meta())
        meta["reasoning_tokens"] = 0  # 2552-2559
        meta["completion_tokens"] = len(self.output_ids)
        meta["cached_tokens"] = 0
        if finished:  # spans only for a finished output (output_streamer.py 540-554)
            spans = self.spans()
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        # one entry per output, None without cached tokens (output_streamer.py 102-133, 529;
        # tokenizer_manager.py 2570-2576)
        meta["cached_tokens_details"] = None
        routes = self.finish.routed_experts if finished else None
        if routes is not None:  # only when asked and served with --enable-return-routed-experts
            meta[META_ROUTED_EXPERTS] = encode_routed_experts(routes.numpy())
        # the scheduler's data-parallel rank, None without a data-parallel controller (one DP
        # rank, as the fleet runs): a list of one None per output, which the tokenizer manager
        # copies (output_streamer.py 718-723, 800; scheduler.py 6316-6332; tokenizer_manager.py
        # 2616-2617)
        meta["dp_rank"] = None
        if finished:
            meta["e2e_latency"] = self.clock.e2e_latency()
            meta.update(self.clock.finish_times(len(self.output_ids)))
        meta.update(self.clock.sent())
        return {
            "text": self.detokenizer.text,
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }


def streamer_sends(spec: Any, made: int) -> bool:
    """Whether SGLang 0.5.23's output streamer, one token a step, sends an unfinished request's
    output once it has ``made`` tokens: a stream's first token at once, then once
    ``stream_interval`` tokens are unsent (at 1, 1 + k, 1 + 2k, ...); an unstreamed request's
    every ``FORCE_STREAM_INTERVAL`` (50) tokens (scheduler_components/output_streamer.py
    455-478, 491-492). A finished request's output is always sent."""
    if spec.stream:
        return made > 0 and (made - 1) % spec.stream_interval == 0
    return made > 0 and made % FORCE_STREAM_INTERVAL == 0


class _Detokenizer:
    """An output's ``text`` as SGLang 0.5.23's detokenizer builds it from the outputs the output
    streamer sends it (:func:`streamer_sends`, then the finish), and its tokenizer manager
    concatenates (managers/tokenizer_manager.py 2629-2633, 2006-2014): :attr:`text`.

    The ids decoded are the prompt's last ids (``context``, :attr:`GenerateSpec.detokenize_context`)
    then the output, starting with ``surr`` 0 and ``read`` past the context
    (managers/schedule_batch.py 1788-1806; detokenizer_manager.py 351-361). Each output decodes
    ``ids[surr:]`` (a finish matched by a stop id or EOS drops its last id unless
    ``no_stop_trim``: ``trim_matched_stop`` 194-226, the tool-call parsers' closing ids it keeps
    are not the fleet's) and ``ids[surr:read]``; the new text is the first past the second's
    length (346-399). Before the finish, new text that does not end in U+FFFD (an incomplete
    character, or an invalid byte) is committed and the offsets advance; otherwise only
    ``find_printable_text`` of it is sent and nothing committed (400-417; sglang/utils.py 320-361).
    The finish sends the committed text and the new text past what was sent (419-430)."""

    def __init__(self, context: tuple[int, ...], decode: Any) -> None:
        self.decode = decode  # ids -> their text
        self.ids = list(context)
        self.surr = 0
        self.read = len(context)
        self.committed = ""
        self.sent_offset = 0  # characters sent: the committed text and a printable tail past it
        self.text = ""

    def step(self, new_ids: list[int], finished: bool, trim: bool) -> None:
        """Take one output: ``new_ids`` (the output ids since the last), whether it is the
        finish, and whether that finish drops its matched stop id."""
        self.ids.extend(new_ids)
        read_ids = self.ids[self.surr :]
        if trim and read_ids:
            read_ids = read_ids[:-1]
        new = self.decode(read_ids)[len(self.decode(self.ids[self.surr : self.read])) :]
        pending = self.sent_offset - len(self.committed)
        if finished:
            whole = self.committed + new
            self.text += whole[self.sent_offset :]
            self.sent_offset = len(whole)
        elif new and not new.endswith("\ufffd"):
            self.committed += new
            self.surr, self.read = self.read, len(self.ids)
            self.sent_offset = len(self.committed)
            self.text += new[pending:]
        else:
            printable = _printable(new)
            self.sent_offset = len(self.committed) + len(printable)
            self.text += printable[pending:]


def _printable(text: str) -> str:
    """SGLang's ``find_printable_text`` (sglang/utils.py 345-361): the longest prefix of whole
    words: all of it after a newline or a final CJK character, all but the last character after
    a CJK one, else up to its last space."""
    if text.endswith("\n") or (text and _cjk(text[-1])):
        return text
    if len(text) > 1 and _cjk(text[-2]):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))  # fmt: skip


def _cjk(char: str) -> bool:
    """SGLang's ``_is_chinese_char`` (sglang/utils.py 320-342): a CJK ideograph block."""
    return any(lo <= ord(char) <= hi for lo, hi in _CJK)


class _Clock:
    """One request's timings as SGLang 0.5.23 reports them with ``--enable-metrics``, measured
    where the engine answers: ``start`` (monotonic) when the request arrived, its first event
    when it entered the forward (so the wait before is its queue time), its first token (or
    finish) as the prefill's end and the first output, its finish event. Wall-clock stamps are
    the monotonic times shifted by one offset, as ``convert_time_to_realtime`` shifts them
    (observability/req_time_stats.py 71-74)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.offset = time.time() - time.monotonic()
        self.forward: float | None = None
        self.first: float | None = None
        self.finished: float | None = None
        self.sent_at: float | None = None

    def saw(self, event: Any) -> None:
        """Note the arrival of one scheduler event (a request answered before any forward, the
        sampling-mask abort, has no forward times)."""
        now = time.monotonic()
        if self.forward is None and isinstance(event, PrefillEvent | TokenEvent):
            self.forward = now
        if self.first is None and isinstance(event, TokenEvent | FinishEvent):
            self.first = now
        if isinstance(event, FinishEvent):
            self.finished = now

    def _real(self, t: float) -> float:
        return t + self.offset

    def scheduler_times(self) -> dict[str, float]:
        """What every output carries: ``forward_entry_time`` and ``prefill_finished_time`` once
        set, ``queue_time`` always (``SchedulerReqTimeStats.convert_to_output_meta_info``,
        observability/req_time_stats.py 1213-1236; tokenizer_manager.py 2515-2518)."""
        times: dict[str, float] = {}
        if self.forward is not None:
            times["forward_entry_time"] = self._real(self.forward)
        if self.first is not None:
            times["prefill_finished_time"] = self._real(self.first)
        times["queue_time"] = 0.0 if self.forward is None else self.forward - self.start
        return times

    def e2e_latency(self) -> float:
        """Arrival to finish (``get_e2e_latency``, req_time_stats.py 486-487)."""
        end = self.finished if self.finished is not None else time.monotonic()
        return end - self.start

    def finish_times(self, completion_tokens: int) -> dict[str, float]:
        """What a finished output adds (``APIServerReqTimeStats.convert_to_output_meta_info``,
        req_time_stats.py 507-533; tokenizer_manager.py 2757-2772): a ``response_sent_to_client_ts``
        only where an earlier chunk was sent; ``decode_throughput`` only past one token with a
        decode time (492-502)."""
        end = self.finished if self.finished is not None else time.monotonic()
        first = self.first if self.first is not None else end
        times = {"request_received_ts": self._real(self.start)}
        if first > self.start:
            times["first_token_latency"] = first - self.start
        times["api_server_dispatch_finish_ts"] = self._real(self.start)
        if self.sent_at is not None:
            times["response_sent_to_client_ts"] = self._real(self.sent_at)
        times["request_finished_ts"] = self._real(end)
        if completion_tokens > 1 and end > first:
            times["decode_throughput"] = (completion_tokens - 1) / (end - first)
        return times

    def sent(self) -> dict[str, float]:
        """``response_sent_to_client_ts`` on the first output sent (a stream's first chunk, or
        the one answer), as ``_stream_one_response`` adds it (tokenizer_manager.py 2024-2029,
        2052-2058); nothing on later ones."""
        if self.sent_at is not None:
            return {}
        self.sent_at = time.monotonic()
        return {"response_sent_to_client_ts": self._real(self.sent_at)}
