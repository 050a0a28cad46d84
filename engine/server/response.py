"""One ``/generate`` item's answer in SGLang's shape, built from the scheduler's events.

:class:`GenerateResponse` accumulates :class:`~engine.runtime.scheduler.TokenEvent`,
``PrefillEvent`` and ``FinishEvent`` and renders ``{"text", "output_ids", "meta_info"}``; the
``meta_info`` fields are listed in :mod:`engine.server.app`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from core.sglang_release import META_ROUTED_EXPERTS, encode_routed_experts
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

    def add(self, event: Any) -> None:
        if isinstance(event, TokenEvent):
            self.output_ids.append(event.draw.token_id)
            self.draws.append(event.draw)
            self.versions.append(event.weight_version)
            self.retractions = event.retractions
        elif isinstance(event, PrefillEvent):
            self.prefill = event
        elif isinstance(event, FinishEvent):
            self.finish = event
            self.retractions = event.retractions

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

    def _text_ids(self) -> list[int]:
        """The ids the answer's ``text`` decodes: SGLang's detokenizer drops the last id of an
        output that a stop id or EOS finished (a ``matched`` id), unless ``no_stop_trim``
        (managers/detokenizer_manager.py ``trim_matched_stop`` 194-226, applied 334-339; the
        tool-call parsers' closing ids it keeps are not the fleet's: no ``--tool-call-parser``).
        ``output_ids`` keep it (scheduler_components/output_streamer.py 490-491)."""
        reason = self.finish.finish_reason if self.finish is not None else {}
        matched = reason.get("matched")
        trim = isinstance(matched, int) and not isinstance(matched, bool) and not self.spec.no_stop_trim
        return self.output_ids[:-1] if trim and self.output_ids else self.output_ids

    def _text(self, token_id: int) -> str | None:
        return self.engine.decode([token_id], False) if self.spec.return_text_in_logprobs else None

    def body(self) -> dict[str, Any]:
        f = finite_or_none
        spec = self.spec
        spans = self.spans()
        meta: dict[str, Any] = {
            "id": spec.rid,
            "finish_reason": self.finish.finish_reason if self.finish is not None else None,
            "prompt_tokens": len(spec.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "num_retractions": self.retractions,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "e2e_latency": time.monotonic() - self.start,
        }
        if spec.return_logprob:
            pre = self.prefill
            logged = self._logged_draws()
            meta["input_token_logprobs"] = (
                [[None if lp is None else f(lp), t, self._text(t)] for lp, t in pre.input_token_logprobs]
                if pre is not None
                else []
            )
            meta["output_token_logprobs"] = [
                [f(d.logprob), d.token_id, self._text(d.token_id)] for d in logged
            ]
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
        if spec.return_sampling_mask:
            meta["output_token_sampling_mask"] = [list(d.support_ids) for d in self.draws]
            if spec.sampling_logprobs_mode == "support":  # SGLang: the support's log-probs per token
                meta["output_token_sampling_logprobs"] = [
                    [f(x) for x in d.support_logprobs] for d in self.draws
                ]
            else:
                meta["output_token_sampling_logprobs"] = [f(d.sampling_logprob) for d in self.draws]
            meta["output_token_sampling_support_logprobs"] = [
                [f(x) for x in d.support_logprobs] for d in self.draws
            ]
            meta["output_token_sampling_mask_length"] = len(self.draws)
        routes = self.finish.routed_experts if self.finish is not None else None
        if routes is not None:  # only when asked and served with --enable-return-routed-experts
            meta[META_ROUTED_EXPERTS] = encode_routed_experts(routes.numpy())
        return {
            "text": self.engine.decode(self._text_ids(), spec.skip_special_tokens),
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }


def dumps(obj: Any) -> bytes:
    """Compact JSON; a non-finite float is an error (callers send them as ``null``)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
