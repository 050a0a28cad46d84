"""What the runtime is asked to run: one validated generation request (:class:`GenerateSpec`),
the model limits a request is validated against (:class:`ModelLimits`), and the refusal of a
request the engine will not run (:class:`RequestError`).

Pure values: ``engine.server.protocol`` builds a :class:`GenerateSpec` from SGLang's HTTP body
and the scheduler (``engine.runtime.scheduler``) runs it; the server answers a
:class:`RequestError` with a 400 carrying its message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.sglang_release import DETOKENIZE_CONTEXT_IDS, SAMPLING_MASK_MAX_TOKENS_DEFAULT
from engine.runtime.sampler import SamplerSettings


class RequestError(ValueError):
    """A request the engine refuses; the message names the problem (HTTP 400). ``body``: the
    JSON body SGLang answers that refusal with where the route answers as SGLang does
    (:func:`core.sglang_contract.error_body`); None: ``{"error": {"message": ...}}``. ``fails``:
    SGLang fails on it rather than refuse it (:attr:`core.sglang_contract.Refusal.fails`)."""

    def __init__(self, message: str, body: dict[str, Any] | None = None, fails: bool = False) -> None:
        super().__init__(message)
        self.body = body
        self.fails = fails


def duplicate_rid(rid: str) -> str:
    """SGLang 0.5.23's refusal of a request whose rid a running request holds
    (``_init_req_state``, managers/tokenizer_manager.py 3833-3837), in its words."""
    return f"Duplicate request ID detected: {rid}"


@dataclass(frozen=True)
class ModelLimits:
    """What a request is validated against: the served model's vocabulary and context."""

    vocab_size: int
    context_len: int
    sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS_DEFAULT


@dataclass(frozen=True)
class GenerateSpec:
    """One validated generation request.

    Holds: ``1 <= len(input_ids) < context_len``; every id in ``[0, vocab_size)``;
    ``len(input_ids) + max_new_tokens <= context_len``;
    ``0 <= logprob_start_len <= len(input_ids)`` (the input's length: no input log-probs).
    """

    rid: str
    input_ids: tuple[int, ...]
    settings: SamplerSettings
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    sampling_seed: int | None
    skip_special_tokens: bool
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_sampling_mask: bool
    return_text_in_logprobs: bool
    stream: bool
    stream_interval: int = 1  # a stream's chunk every this many tokens, after the first at once
    sampling_logprobs_mode: str = "selected"
    no_stop_trim: bool = False  # the answer's text keeps a matched stop id or EOS (SGLang's detokenizer)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # the finish reason SGLang's scheduler answers this request with at once when it takes it,
    # running nothing (the sampling-mask rule's prepare_abort; a 400,
    # core.sglang_release.scheduler_abort): such a request is answered that abort, never submitted
    abort: dict[str, Any] | None = None
    # SGLang's Req.to_finish as Req.set_finish_with_abort leaves it (see with_finish_abort): the
    # scheduler runs the request and finishes it with this reason once it drew its first token
    to_finish: dict[str, Any] | None = None
    # SGLang's Req.origin_input_ids_unpadded where with_finish_abort replaced input_ids; None:
    # input_ids (see detokenize_context)
    origin_input_ids_unpadded: tuple[int, ...] | None = None

    @property
    def detokenize_context(self) -> tuple[int, ...]:
        """The prompt ids SGLang 0.5.23's detokenizer decodes the output after: the last
        ``DETOKENIZE_CONTEXT_IDS`` (5) of ``Req.origin_input_ids_unpadded``
        (``init_incremental_detokenize``, managers/schedule_batch.py 1788-1806), which
        ``set_finish_with_abort`` leaves as the client's prompt: it replaces only
        ``origin_input_ids`` (2233-2235; the two are one list until then, 1091-1095)."""
        prompt = self.input_ids if self.origin_input_ids_unpadded is None else self.origin_input_ids_unpadded
        return prompt[-DETOKENIZE_CONTEXT_IDS:]

    @property
    def scheduler_abort(self) -> dict[str, Any] | None:
        """The abort SGLang's scheduler answers this request with (:attr:`abort` or
        :attr:`to_finish`), or None."""
        return self.abort if self.abort is not None else self.to_finish

    def with_finish_abort(
        self, reason: dict[str, Any], routed_experts_start_len: int | None = None
    ) -> GenerateSpec:
        """This request as SGLang 0.5.23's ``Req.set_finish_with_abort`` leaves it
        (managers/schedule_batch.py 2221-2238): its input the one token 0 ("to skip the long
        prefill"), no input log-probs computed (``return_logprob`` false, ``logprob_start_len`` -1
        on the scheduler's request), ``to_finish`` ``reason``; its other sampling parameters kept;
        the client's prompt kept as ``origin_input_ids_unpadded`` (:attr:`detokenize_context`).
        ``return_logprob`` and ``top_logprobs_num`` stay as asked: the tokenizer manager answers the
        log-prob keys the client asked for (managers/tokenizer_manager.py 2520-2529), empty, as
        nothing was computed (the answer's job: ``engine.server.response``).
        ``routed_experts_start_len``: the start the abort sets (0 for the routed experts' own,
        managers/scheduler.py 3315-3316), None to keep it."""
        start = (
            self.routed_experts_start_len if routed_experts_start_len is None else routed_experts_start_len
        )
        return dataclasses.replace(
            self,
            input_ids=(0,),
            origin_input_ids_unpadded=self.input_ids,
            logprob_start_len=1,
            to_finish=reason,
            routed_experts_start_len=start,
        )
