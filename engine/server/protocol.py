"""SGLang's native HTTP request bodies, as pydantic models, and their normalization.

``GenerateReqInput`` mirrors SGLang's ``/generate`` body (single request or a batch: ``text``
a list, or ``input_ids`` a list of lists; per-item fields may be scalars shared by the batch
or lists with one entry per item). :meth:`GenerateReqInput.normalize` turns it into one frozen
:class:`~engine.runtime.request.GenerateSpec` (what the runtime schedules) per item, validated
against the served model, or raises :class:`~engine.runtime.request.RequestError` (the server
answers 400 with its message, SGLang-style).

Before any of it, the body passes SGLang 0.5.23's own judgment of the fields the fleet sends
(:func:`core.sglang_contract.generate_body_refusal` through the dataclass parse and the contract
gate; ``SamplingParams.verify`` per item in :meth:`GenerateReqInput.normalize`, after the item's
other step-3 checks, as SGLang): ``true``, ``"1"`` or ``3.0`` among ``input_ids`` or
``sampling_params.stop_token_ids``, a ``stream`` that is not a JSON bool, a float ``top_k``, an
unknown ``sampling_params`` key or a value out of SGLang's ranges is a 400 naming the field, in
the body shape of the SGLang step that refuses it (:func:`core.sglang_contract.error_body`).
Other validation messages follow SGLang's ``TokenizerManager`` wording where SGLang has one.

No top-level field is silently ignored where SGLang would act on it: one SGLang refuses on a server
started as the fleet starts it (``lora_path``, ``input_embeds``, ``return_hidden_states``, ...) is
refused in SGLang's words, one SGLang honours that this engine does not implement
(``token_ids_logprob``, ``session_params``, ...) at a value asking for anything is refused as "not
supported by the mixfleet CPU engine", as ``_UNSUPPORTED_DEFAULTS`` refuses sampling parameters
(:meth:`GenerateReqInput.unimplemented_refusal`), once nothing SGLang refuses is left: step 3 runs
in SGLang's order (:meth:`GenerateReqInput.normalize`), and a streamed request's step-3 refusal is
answered inside its stream (``engine.server.routes_generate``). What SGLang ignores on such a
server, an unknown key included, is accepted and ignored here too. A watermark
(``sampling_params.watermark`` or the top-level ``watermark``) is judged as SGLang without
``--enable-watermark`` judges it: set both ways or malformed by the contract check, ahead of the
ranges as in SGLang, the rest by :func:`watermark_refusal`; ``beam_width`` above 1 is refused as not
supported, any ``sampling_params.choice`` (a 500 in SGLang) as a 400 naming it; ``stream_interval``
is honoured (``engine.server.routes_generate``).

Sampling masks follow SGLang 0.5.23 (:mod:`core.sglang_release`): ``return_sampling_mask``
needs a normalized ``top_k`` of 1 or ``1 < top_k <= sampling_mask_max_tokens`` (else a 400 in
SGLang's words); ``sampling_logprobs_mode`` (``selected`` | ``support``) may only be set with it.
A mask of a token drawn with no active filter (a ``top_k`` of at least the vocabulary, no top-p
or min-p) is empty, meaning "the whole vocabulary" (SGLang lists every id).

Routed experts (:mod:`core.sglang_release`): ``return_routed_experts`` and
``routed_experts_start_len`` are one value for the whole batch, as in SGLang; a start outside
``[0, prompt tokens]`` of an item is the scheduler's abort of it in SGLang's words (unstreamed a
400; streamed, its one-token event: ``engine.server.routes_generate``).
"""

from __future__ import annotations

import dataclasses
import reprlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from core.sglang_contract import (
    Refusal,
    batch_refusal,
    generate_body_refusal,
    item_refusal,
    list_for_one_refusal,
    max_new_tokens_bound,
    scheduler_failure_refusal,
    short_list_refusal,
)
from core.sglang_release import (
    SAMPLING_LOGPROBS_MODES,
    input_length_error,
    logprob_start_error,
    mask_top_k_error,
    routed_experts_start_error,
    scheduler_abort,
)
from core.sglang_release import TOP_K_ALL as SGLANG_TOP_K_ALL
from engine.runtime.request import GenerateSpec, ModelLimits, RequestError, duplicate_rid
from engine.runtime.sampler import TOP_K_ALL, SamplerSettings
from weight_sync.types import InvalidVersion
from weight_sync.types import parse_version as parse_weight_version

_SAMPLING_EPS = 1e-6
# Sampling parameters SGLang accepts that this engine does not implement; a non-default value
# is rejected with a clear message instead of being silently ignored.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "stop": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    # beam search (SamplingParams.beam_width > 1, sampling_params.py 166-168; io_struct.py
    # 517-529); null or 1 is one sample, below 1 SGLang's verify refuses (253-254)
    "beam_width": 1,
}


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params`` object, already judged by
    :func:`core.sglang_contract.generate_body_refusal` (types, known keys, SGLang's ranges) when
    its :class:`GenerateReqInput` was built.

    ``spaces_between_special_tokens`` is taken and changes nothing, as in SGLang 0.5.23 with the
    fast tokenizer it loads: its detokenizer passes the flag to ``batch_decode``
    (managers/detokenizer_manager.py 270-300), which in the transformers its wheel pins
    (``transformers==5.19.0``, ``tokenizers==0.23.2``) forwards it to ``decode`` and
    ``TokenizersBackend._decode`` (transformers/tokenization_utils_base.py 2854-2939;
    tokenization_utils_tokenizers.py 1122-1163, ``is_fast`` 527-529), which takes it in
    ``**kwargs`` and never reads it: the ``tokenizers`` library's decode has no such option. A
    slow tokenizer's path drops it too (``decode_without_hf_kwargs``, utils/patch_tokenizer.py
    54-62)."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: int | None = 128
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = TOP_K_ALL
    min_p: float | None = 0.0
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False

    def to_settings(self) -> SamplerSettings:
        """The sampler settings (SGLang's ``__post_init__``: temperature below 1e-6 is greedy,
        whatever ``top_k`` says, sampling/sampling_params.py 245-250); a parameter this engine does
        not implement, at a value other than its default, raises :class:`RequestError` (a
        ``choice`` never gets here: :data:`core.sglang_contract.NO_CHOICE`)."""
        extra = self.model_extra or {}
        for name, default in _UNSUPPORTED_DEFAULTS.items():
            value = extra.get(name, default)
            if value is not None and value != default and value != [] and value != {}:
                raise RequestError(
                    f"sampling_params.{name}={value!r} is not supported by the mixfleet CPU engine."
                )
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        if temperature < _SAMPLING_EPS:
            # SGLang: temperature 0 means greedy (top_k = 1 at temperature 1).
            return SamplerSettings(temperature=0.0, top_p=1.0, top_k=1, min_p=0.0)
        top_p = 1.0 if self.top_p is None else float(self.top_p)
        top_k = TOP_K_ALL if self.top_k is None else int(self.top_k)
        min_p = 0.0 if self.min_p is None else float(self.min_p)
        return SamplerSettings(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)

    def stream_interval(self) -> int:
        """Every how many tokens a stream sends a chunk (after the first token at once), as
        SGLang's output streamer reads it (``stream_interval or`` the server's default 1, and
        ``stream_interval == 1 or num_unsent >= stream_interval``: 0 or below is every token;
        scheduler_components/output_streamer.py 455-469, arg_groups/fields/serving.py 262-265)."""
        value = (self.model_extra or {}).get("stream_interval")
        return value if isinstance(value, int) and value > 1 else 1

    def watermark(self) -> Any:
        """``sampling_params.watermark`` as sent (None when absent)."""
        return (self.model_extra or {}).get("watermark")


WATERMARK_CONTEXT_WINDOW = 4  # the server's default (srt/arg_groups/fields/exec_.py 92-95)


def watermark_refusal(top: Any, params: SamplingParams) -> str | None:
    """SGLang 0.5.23's refusal of one item's watermark on a server started as the fleet starts
    it (no ``--enable-watermark``, which needs CUDA: arg_groups/validation_hook.py 34-44), in
    its words, or None where the item asks for no watermark. ``top`` is the item's top-level
    ``watermark`` (io_struct.py 228, 749-757), ``params`` its ``sampling_params``. A watermark
    set both ways or malformed was refused before, ahead of ``SamplingParams.verify`` as in
    SGLang (:func:`core.sglang_contract.watermark_malformed`); this is
    ``resolve_watermark_request`` with ``server_enabled=False``, run after ``verify``
    (watermarking/core.py 196-242, via tokenizer_manager.py 213-223, 1568). Only ``null``, or
    ``enabled: false`` with no key and a ``context_window`` of 1 to 4, passes."""
    config = params.watermark() if top is None else top
    if config is None:
        return None
    enabled, key, window = config.get("enabled"), config.get("key"), config.get("context_window")
    if window is not None and window > WATERMARK_CONTEXT_WINDOW:
        return "request watermark context_window cannot exceed the server's watermark context_window"
    if enabled is False:
        return None if key is None else "request watermark key cannot be combined with enabled=false"
    if enabled is not True and key is None:
        return "request watermark must set enabled or key"
    return "request watermarking requires the server to enable --enable-watermark"


def _lora_refusal(paths: list[str | None] | str | None) -> str | None:
    """``tokenizer_manager.py`` 3723-3740: any ``lora_path`` (``[None]`` too) without ``--enable-lora``."""
    if not paths:
        return None
    first = paths if isinstance(paths, str) else next((a for a in paths if a), None)
    return (
        f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
        "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
    )


def _hidden_states_refusal(mode: Any) -> str | None:
    """``tokenizer_manager.py`` 1394-1410: a mode above the server's (none without
    ``--return-hidden-states-mode``; ``False`` asks for none, schedule_batch.py 179-205)."""
    if not any(m is not False for m in (mode if isinstance(mode, list) else [mode])):
        return None
    return (
        "The server is not configured to return hidden states. Please set `--return-hidden-states-mode "
        "last`, `--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
    )


def _set(value: Any) -> bool:
    """Whether a field SGLang reads as ``if value:`` asks for anything."""
    return bool(value)


# Top-level fields SGLang 0.5.23 refuses on a server started as the fleet starts it (no LoRA,
# hidden states, custom logit processor, strict thinking or data parallelism; the radix cache
# on), each with SGLang's words, or None where the value asks for nothing. Judged on the whole
# request, in SGLang's order, before any item is tokenized: ``generate_request`` checks the
# priority (904, ``_set_default_priority`` 4013-4025), ``max_thinking_tokens`` (905-913),
# ``routed_dp_rank`` (915-924), then registers the rids (926, ``_init_req_state``: a rid a
# running request holds, 3833-3837) and only then the LoRA adapters (942,
# ``_validate_and_resolve_lora``), which :meth:`GenerateReqInput.normalize` checks after the rids.
_SGLANG_REFUSES: dict[str, Callable[[Any], str | None]] = {
    "priority": lambda v: (
        None  # without priority scheduling it is otherwise ignored
        if v is None or -(1 << 63) <= v < (1 << 63)
        else "priority must be a signed 64-bit integer between -9223372036854775808 and 9223372036854775807"
    ),
    "max_thinking_tokens": lambda v: (
        None
        if v is None
        else "max_thinking_tokens requires the server to be launched with --enable-strict-thinking"
    ),
    # one data-parallel rank: 0 is ignored, another is out of range
    "routed_dp_rank": lambda v: None if v in (None, 0) else f"routed_dp_rank={v} out of range [0, 1)",
}

# Top-level fields SGLang refuses per item, as ``_tokenize_one_request`` tokenizes that item
# (tokenizer_manager.py 1096-1434): ``input_embeds`` first (1109-1114), then, after the context
# length (1336-1375, :func:`_spec`), the hidden states (1393-1410) and the custom logit
# processor (1411-1419); each item's ``SamplingParams`` come after them all (1548-1567).
_INPUT_EMBEDS_REFUSAL = (
    "input_embeds is provided while disable_radix_cache is False. Please add "
    "`--disable-radix-cache` when you launch the server if you want to use input_embeds as inputs."
)


def _token_ids_logprob_refusal(ids: Any, vocab_size: int) -> str | None:
    """``_validate_token_ids_logprob`` (tokenizer_manager.py 1513-1531) on one item's
    ``token_ids_logprob``, in its words: each id in turn, one that is no integer (a row of a batch's
    lists sent with one request) or outside the vocabulary refused. Run after the context length
    and before the hidden states (1336-1393); this engine then refuses any it is sent as not
    implemented (:data:`_UNIMPLEMENTED`), after everything SGLang refuses."""
    if not ids:
        return None
    if not isinstance(ids, list):
        return "token_ids_logprob must be a flat list of integers."
    for token_id in ids:
        if not isinstance(token_id, int):
            return "token_ids_logprob must be a flat list of integers."
        if token_id < 0 or token_id >= vocab_size:
            return (
                f"token_ids_logprob contains out-of-vocabulary token id {token_id}; "
                f"valid range is [0, {vocab_size})."
            )
    return None


def _custom_logit_processor_refusal(v: Any) -> str | None:
    if not v:
        return None
    return (
        "The server is not configured to enable custom logit processor. "
        "Please set `--enable-custom-logit-processor` to enable this feature."
    )


# Top-level fields SGLang honours that this engine does not implement: a value that asks for
# anything (SGLang reads each as ``if value:`` or ``is not None``) is refused, as
# ``_UNSUPPORTED_DEFAULTS`` refuses sampling parameters, instead of being silently ignored.
_UNIMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "token_ids_logprob": _set,  # tokenizer_manager.py 1513-1520, 2975-3000
    "session_params": _set,  # tokenizer_manager.py 1572-1574
    "return_flat_raw_top_logprobs": _set,  # tokenizer_manager.py 2876
    "return_flat_raw_output_top_logprobs": _set,  # tokenizer_manager.py 2939
    "return_flat_raw_top_logprobs_b64": _set,  # io_struct.py 250-254
    "return_prompt_token_ids": _set,  # tokenizer_manager.py 948
    "positional_embed_overrides": lambda v: v is not None,  # tokenizer_manager.py 1605, 1630-1646
    "multi_item_delimiter_indices": lambda v: v is not None,  # tokenizer_manager.py 1624
    "token_indices_to_pool": lambda v: v is not None,  # tokenizer_manager.py 1625
}


class GenerateReqInput(BaseModel):
    """SGLang's ``/generate`` body. The fields this engine implements are served; the top-level
    fields SGLang refuses on a server started as the fleet starts SGLang (``lora_path``,
    ``input_embeds``, ``return_hidden_states``, ``custom_logit_processor``, ``max_thinking_tokens``,
    a ``routed_dp_rank`` / ``data_parallel_rank`` other than 0, a ``priority`` beyond int64) are
    refused in SGLang's words and order (:meth:`normalize`), and those SGLang honours that this
    engine does not implement (``token_ids_logprob``, ``session_params``, the ``return_flat_raw_*``
    flags, ``return_prompt_token_ids``, ``positional_embed_overrides``,
    ``multi_item_delimiter_indices``, ``token_indices_to_pool``) at a value asking for anything are
    refused as not supported (a 400 naming the field, :meth:`unimplemented_refusal`). The rest
    SGLang ignores on such a server (text-only model: the multimodal fields; no disaggregation,
    HiCache or priority scheduling: ``bootstrap_*``, ``kv_hints``, ``priority``; bookkeeping:
    ``session_id``, ``routing_key``, ``custom_labels``, ...), and so does this engine; so too an
    unknown key, which SGLang's parse and gate both skip (:mod:`core.sglang_contract`)."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_sampling_mask: bool | list[bool] | None = None
    sampling_logprobs_mode: (
        Literal["selected", "support"] | list[Literal["selected", "support"] | None] | None
    ) = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    # SGLang takes both as one value for the whole batch (managers/io_struct.py 263-268)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # typed as SGLang's dataclass types them (managers/io_struct.py 193, 237, 250-254, 260-262,
    # 274-284, 288, 298-303, 320, 323, 337, 362, 367): its parse is SGLang's first step
    input_embeds: list[list[list[float]]] | list[list[float]] | None = None
    lora_path: list[str | None] | str | None = None
    return_hidden_states: list[bool | Literal["last"]] | bool | Literal["last"] = False
    custom_logit_processor: list[str | None] | str | None = None
    max_thinking_tokens: int | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None  # SGLang's deprecated alias (io_struct.py 419-429)
    priority: int | None = None
    token_ids_logprob: list[list[int]] | list[int] | None = None
    session_params: dict[str, Any] | None = None
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_output_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    return_prompt_token_ids: bool = False
    positional_embed_overrides: Any = None
    multi_item_delimiter_indices: list[list[int]] | list[int] | None = None
    token_indices_to_pool: list[list[int]] | list[int] | None = None
    # any JSON, judged per item by watermark_refusal (io_struct.py 228: ``Any``, no gate key)
    watermark: Any = None

    # the body as sent, for step 3's checks of SamplingParams (core.sglang_contract.item_refusal)
    _body: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _sglang_contract(cls, data: Any, handler: Any) -> Any:
        """SGLang's first two steps on the body (:mod:`core.sglang_contract`: the dataclass parse
        and the contract gate), one line naming the field, before pydantic's lax types could
        coerce ``"1"`` or ``true``; step 3 is :meth:`normalize`'s, in SGLang's order."""
        refused = generate_body_refusal(data, through="gate")
        if refused is not None:  # its step and line ride along: the route answers SGLang's shape
            raise PydanticCustomError(
                "sglang_contract", "{message}", {"message": refused.message, "step": refused.step}
            )
        obj = handler(data)
        obj._body = data
        return obj

    def is_batch(self) -> bool:
        """Whether the request is a batch: ``text`` a list, else ``input_ids`` a list of lists;
        ``text`` decides when both are sent (``_determine_batch_size``, io_struct.py 479-487),
        and each item's tokens are then its ``input_ids`` row (tokenizer_manager.py 1118)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def sglang_refusal(self) -> str | None:
        """SGLang's refusal, in its words, of what it judges on the whole request before any item
        is tokenized, in its order (:data:`_SGLANG_REFUSES`), or None."""
        rank = self.data_parallel_rank if self.routed_dp_rank is None else self.routed_dp_rank
        fields = {name: getattr(self, name) for name in _SGLANG_REFUSES} | {"routed_dp_rank": rank}
        for name, refusal in _SGLANG_REFUSES.items():
            message = refusal(fields[name])
            if message is not None:
                return message
        return None

    def unimplemented_refusal(self) -> str | None:
        """The first top-level field SGLang serves and this engine does not (:data:`_UNIMPLEMENTED`)
        set to a value asking for anything, as one line naming it, or None."""
        for name, asks in _UNIMPLEMENTED.items():
            value = getattr(self, name)
            if asks(value):
                return f"{name}={reprlib.repr(value)} is not supported by the mixfleet CPU engine."
        return None

    def normalize(
        self,
        limits: ModelLimits,
        encode: Callable[[str], list[int]] | None,
        held: Callable[[list[str]], str | None] | None = None,
    ) -> list[GenerateSpec]:
        """One :class:`GenerateSpec` per item; raises :class:`RequestError` on any bad field.

        Step 3 of SGLang's judgment (what ``tokenizer_manager.generate_request`` raises, which a
        stream answers inside its 200: ``engine.server.routes_generate``), in SGLang's order:
        ``normalize_batch_and_arguments`` (:func:`core.sglang_contract.batch_refusal`: the inputs
        first), the whole request's refusals
        (:meth:`sglang_refusal`), a short list (:func:`core.sglang_contract.short_list_refusal`), a
        rid a running request holds (``held``: the first of the
        request's rids one holds, or None; every rid is checked before anything is submitted, so a
        batch, streamed or not, is refused whole, as ``_init_req_state`` refuses it,
        tokenizer_manager.py 926, 3833-3837), the LoRA adapters (942), then each item in turn as
        ``_tokenize_one_request`` /
        ``_create_tokenized_object`` judge it (:func:`_spec`: ``input_embeds``, the context
        length, hidden states, the custom logit processor, then its ``SamplingParams``,
        :func:`core.sglang_contract.item_refusal`); what this engine does not
        implement (:meth:`unimplemented_refusal`) only after all SGLang would refuse."""
        batch, n, rids = self._whole_request(held)
        if self.text is not None and self.input_ids is None and encode is None:
            raise RequestError("text input needs a tokenizer; this model directory has none.")
        params = self._per_item("sampling_params", self._batch_sampling_params(batch), n, None)
        list_refused = list_for_one_refusal(self._body)  # a list on one request: SGLang's 500
        return_logprob = self._per_item("return_logprob", self.return_logprob, n, False)
        start = self._per_item("logprob_start_len", self.logprob_start_len, n, -1)
        top_n = self._per_item("top_logprobs_num", self.top_logprobs_num, n, 0)
        masks = self._per_item("return_sampling_mask", self.return_sampling_mask, n, False)
        modes = self._per_item("sampling_logprobs_mode", self.sampling_logprobs_mode, n, None)
        hidden, processors = [self.return_hidden_states], [self.custom_logit_processor]
        if batch:  # a batch's list has one per item (io_struct.py __getitem__)
            hidden = self._per_item("return_hidden_states", self.return_hidden_states, n, False)
            processors = self._per_item("custom_logit_processor", self.custom_logit_processor, n, None)
        marks = self._watermarks(batch, n)
        logprob_ids = self._token_ids_logprob_items(batch, n)
        specs = []
        for i in range(n):
            if self.input_embeds is not None:  # tokenizer_manager.py 1109-1114, before the input
                raise RequestError(_INPUT_EMBEDS_REFUSAL)
            if self.input_ids is not None:
                ids: list[int] = self.input_ids[i] if batch else self.input_ids  # type: ignore[assignment]
            else:
                ids = encode(self.text[i] if batch else self.text)  # type: ignore[misc, index, arg-type]
            specs.append(
                _spec(
                    f"input_ids[{i}]" if batch else "input_ids",
                    rid=rids[i] if rids[i] is not None else uuid.uuid4().hex,
                    input_ids=ids,
                    params=params[i] or SamplingParams(),
                    sampling_refusal=lambda i=i: item_refusal(self._body, i),
                    list_refusal=list_refused,
                    return_logprob=bool(return_logprob[i]),
                    logprob_start_len=-1 if start[i] is None else int(start[i]),
                    top_logprobs_num=int(top_n[i] or 0),
                    return_sampling_mask=bool(masks[i]),
                    sampling_logprobs_mode=modes[i],
                    return_hidden_states=hidden[i],
                    custom_logit_processor=processors[i],
                    token_ids_logprob=logprob_ids[i],
                    watermark=marks[i],
                    return_text_in_logprobs=self.return_text_in_logprobs,
                    stream=self.stream,
                    limits=limits,
                )
            )
        failure = scheduler_failure_refusal(self._body)  # what the scheduler fails on, after all the above
        if failure is not None:
            raise _refused(failure)
        refused = self.unimplemented_refusal()
        if refused is not None:
            raise RequestError(refused)
        return self._routed_experts(specs) if self.return_routed_experts else specs

    def _whole_request(self, held: Callable[[list[str]], str | None] | None) -> tuple[bool, int, list[Any]]:
        """Step 3's checks of the whole request, before any item's, in SGLang's order (see
        :meth:`normalize`); whether it is a batch, its size, and each item's rid as sent (None
        where none was). Raises :class:`RequestError`."""
        refused_body = batch_refusal(self._body)  # the inputs first (_validate_inputs, io_struct.py 431)
        if refused_body is not None:
            raise _refused(refused_body)
        refused = self.sglang_refusal()
        if refused is not None:
            raise RequestError(refused)
        short = short_list_refusal(self._body)  # _init_req_state builds every item first
        if short is not None:
            raise _refused(short)
        batch = self.is_batch()
        n = len(self.text if self.text is not None else self.input_ids) if batch else 1  # type: ignore[arg-type]
        if n == 0:
            raise RequestError("The input batch is empty.")
        rids = self._per_item("rid", self.rid, n, None)
        taken = None if held is None else held([r for r in rids if r is not None])
        if taken is not None:  # _init_req_state, tokenizer_manager.py 3833-3837: the whole request
            raise RequestError(duplicate_rid(taken))
        refused = _lora_refusal(self.lora_path)  # tokenizer_manager.py 942, 3723-3740
        if refused is not None:
            raise RequestError(refused)
        return batch, n, rids

    def _routed_experts(self, specs: list[GenerateSpec]) -> list[GenerateSpec]:
        """``specs`` returning routed experts from ``routed_experts_start_len``, one start for the
        batch (:func:`_with_routed_experts`)."""
        start = self.routed_experts_start_len
        return [_with_routed_experts(s, start) for s in specs]

    def _batch_sampling_params(self, batch: bool) -> Any:
        """``sampling_params`` as the items read it: one request's list is its first entry (the
        list itself is refused, :func:`core.sglang_contract.list_for_one_refusal`, unless ``n``
        makes it parallel samples, which this engine refuses after)."""
        if not batch and isinstance(self.sampling_params, list):
            return self.sampling_params[0]
        return self.sampling_params

    def _token_ids_logprob_items(self, batch: bool, n: int) -> list[Any]:
        """Each item's ``token_ids_logprob`` as SGLang hands it to the item (io_struct.py
        ``_normalize_logprob_params`` 809-821, ``__getitem__`` 987): a batch's list of lists one
        row per item (a row past the list's end: none), any other value every item's."""
        value = self.token_ids_logprob
        if batch and value and isinstance(value[0], list):
            return [value[i] if i < len(value) else None for i in range(n)]
        return [value] * n

    def _watermarks(self, batch: bool, n: int) -> list[Any]:
        """Each item's top-level ``watermark``: a batch's list has one per item (its length was
        judged with the body, :func:`core.sglang_contract.generate_body_refusal`), anything else
        is every item's (io_struct.py 749-757)."""
        return self.watermark if batch and isinstance(self.watermark, list) else [self.watermark] * n

    def _per_item(self, name: str, value: Any, n: int, default: Any) -> list[Any]:
        """Each of the ``n`` items' ``name``: a batch's list its first ``n`` entries (SGLang reads
        entry ``i`` for item ``i``, io_struct.py 959-1031, and never a longer list's rest; a
        shorter one was refused before, :data:`core.sglang_contract.NO_SHORT_LIST`, or its length
        checked, :func:`core.sglang_contract.batch_refusal`), one value every item's, None the
        default. One request's list is read as the default: SGLang keeps it as the request's one
        value, which the request is refused for (a ``rid`` list with the short lists,
        :func:`core.sglang_contract.short_list_refusal`; the others once every earlier check has
        run, :func:`core.sglang_contract.scheduler_failure_refusal`)."""
        if isinstance(value, list):
            if not self.is_batch():
                return [default] * n
            if len(value) < n:
                raise RequestError(f"{name} has {len(value)} entries for a batch of {n}.")
            return value[:n]
        if value is None:
            return [default] * n
        if name == "rid" and n > 1:  # _normalize_rid, io_struct.py 759-765
            return [f"{value}_{i}" for i in range(n)]
        return [value] * n


def _settings(params: SamplingParams, watermark: Any) -> SamplerSettings:
    """An item's sampler settings (:meth:`SamplingParams.to_settings`), its watermark judged
    first (:func:`watermark_refusal`); raises :class:`RequestError`."""
    refused = watermark_refusal(watermark, params)
    if refused is not None:
        raise RequestError(refused)
    return params.to_settings()


def _refused(refusal: Refusal) -> RequestError:
    """The :class:`RequestError` of a refusal of :mod:`core.sglang_contract` (step 3's)."""
    return RequestError(refusal.message, fails=refusal.fails)


def _length_refusal(n: int, max_new_tokens: int | None, context_len: int, listed: Refusal | None) -> None:
    """SGLang's context-length checks of an item of ``n`` prompt tokens, in its words
    (``_validate_one_request``, tokenizer_manager.py 1336-1375): the input, then ``listed`` (a
    list ``sampling_params`` on one request, which SGLang fails on reading ``max_new_tokens``,
    1354), then the total with a ``max_new_tokens`` it was sent (null has no bound but the
    context's, :func:`core.sglang_contract.max_new_tokens_bound`). Raises :class:`RequestError`."""
    if n >= context_len:
        raise RequestError(
            f"The input ({n} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    if listed is not None:
        raise _refused(listed)
    if max_new_tokens is not None and n + max_new_tokens > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {n + max_new_tokens} tokens: {n} tokens from the "
            f"input messages and {max_new_tokens} tokens for the completion. Please reduce the "
            f"number of tokens in the input messages or the completion to fit within the limit."
        )


def _logprob_start(start_len: int, return_logprob: bool, n: int) -> int:
    """The first prompt position an item of ``n`` prompt tokens answers input log-probs from, as
    SGLang 0.5.23's scheduler resolves ``logprob_start_len`` (managers/scheduler.py 3256-3279):
    without ``return_logprob`` none (it keeps -1 whatever was sent); -1 the input's length (output
    log-probs only: ``input_token_logprobs: []``), as is a start equal to it. A start above it is
    the scheduler's abort (:func:`_scheduler_aborts`); one below -1 with ``return_logprob``, which
    SGLang fails on, is refused after every item is judged
    (:data:`core.sglang_contract.NO_LOGPROB_START_BELOW`): both read as none here."""
    return start_len if return_logprob and 0 <= start_len <= n else n


def _scheduler_aborts(
    spec: GenerateSpec, mask_refused: str | None, logprob_start_len: int, context_len: int
) -> GenerateSpec:
    """``spec`` with the first of the aborts SGLang 0.5.23's scheduler makes of the item when it
    takes it, in its order (``_handle_generate_request``, managers/scheduler.py): the sampling-mask
    rule (3160-3182: ``_reject_sampling_mask_request``, 3513-3518, answers at once, nothing run,
    ``err_type`` none: :attr:`GenerateSpec.abort`), a prompt within 6 tokens of the context
    (3243-3253, :func:`core.sglang_release.input_length_error`), a ``logprob_start_len`` past the
    input with ``return_logprob`` (3256-3279, :func:`core.sglang_release.logprob_start_error`),
    both ``set_finish_with_abort`` (:meth:`GenerateSpec.with_finish_abort`); the routed experts'
    start comes last (3300-3319, :func:`_with_routed_experts`); ``spec`` itself without one."""
    if mask_refused is not None:
        return dataclasses.replace(spec, abort=scheduler_abort(mask_refused, None))
    n = len(spec.input_ids)
    message = input_length_error(n, context_len)
    if message is None and spec.return_logprob:
        message = logprob_start_error(logprob_start_len, n)
    return spec if message is None else spec.with_finish_abort(scheduler_abort(message))


def _with_routed_experts(spec: GenerateSpec, start: int) -> GenerateSpec:
    """``spec`` returning routed experts from ``start``; an item no earlier abort took whose prompt
    ``start`` lies outside is aborted as SGLang's scheduler aborts it (managers/scheduler.py
    3300-3319: ``set_finish_with_abort`` with ``routed_experts_start_len`` 0)."""
    spec = dataclasses.replace(spec, return_routed_experts=True, routed_experts_start_len=start)
    if spec.scheduler_abort is not None:
        return spec
    message = routed_experts_start_error(start, len(spec.input_ids))
    return spec if message is None else spec.with_finish_abort(scheduler_abort(message), 0)


def _spec(
    where: str,
    *,
    rid: str,
    input_ids: Sequence[int],
    params: SamplingParams,
    sampling_refusal: Callable[[], Refusal | None],
    list_refusal: Refusal | None,
    return_logprob: bool,
    logprob_start_len: int,
    top_logprobs_num: int,
    return_sampling_mask: bool,
    sampling_logprobs_mode: str | None,
    return_hidden_states: Any,
    custom_logit_processor: Any,
    token_ids_logprob: Any,
    watermark: Any,
    return_text_in_logprobs: bool,
    stream: bool,
    limits: ModelLimits,
) -> GenerateSpec:
    if len(input_ids) == 0:
        raise RequestError(f"{where} is empty: the prompt must have at least one token.")
    bad = [t for t in input_ids if not (0 <= t < limits.vocab_size)]
    if bad:
        raise RequestError(
            f"{where} has token id {bad[0]} outside the vocabulary [0, {limits.vocab_size - 1}]"
            + (f" ({len(bad)} such ids)." if len(bad) > 1 else ".")
        )
    n = len(input_ids)
    _length_refusal(n, params.max_new_tokens, limits.context_len, list_refusal)
    refused = _token_ids_logprob_refusal(token_ids_logprob, limits.vocab_size)  # 1393, 1513-1531
    refused = refused or _hidden_states_refusal(return_hidden_states)  # tokenizer_manager.py 1394-1410
    refused = refused or _custom_logit_processor_refusal(custom_logit_processor)  # 1411-1419
    if refused is not None:
        raise RequestError(refused)
    if sampling_logprobs_mode is not None and not return_sampling_mask:  # 1427-1433
        raise RequestError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    ruled = sampling_refusal()  # SamplingParams (tokenizer_manager.py 1548-1567)
    if ruled is not None:
        raise _refused(ruled)
    settings = _settings(params, watermark)
    if sampling_logprobs_mode not in (None, *SAMPLING_LOGPROBS_MODES):
        raise RequestError(f"sampling_logprobs_mode must be one of {SAMPLING_LOGPROBS_MODES}.")
    mask_refused = None
    if return_sampling_mask:
        # SGLang's rule on the normalized top_k (greedy: 1; -1: the whole vocabulary)
        top_k = 1 if settings.greedy else SGLANG_TOP_K_ALL if settings.top_k == TOP_K_ALL else settings.top_k
        mask_refused = mask_top_k_error(top_k, limits.sampling_mask_max_tokens)
    max_new = max_new_tokens_bound(params.max_new_tokens, n, limits.context_len)
    # SGLang keeps any integer here (sampling_params.py 201-205; nothing checks the vocabulary):
    # an id outside it never matches.
    stops = frozenset(params.stop_token_ids or ())
    spec = GenerateSpec(
        rid=str(rid),
        input_ids=tuple(int(t) for t in input_ids),
        settings=settings,
        max_new_tokens=int(max_new),
        stop_token_ids=stops,
        ignore_eos=bool(params.ignore_eos),
        sampling_seed=params.sampling_seed,
        skip_special_tokens=params.skip_special_tokens is not False,
        no_stop_trim=bool(params.no_stop_trim),
        return_logprob=return_logprob,
        logprob_start_len=_logprob_start(logprob_start_len, return_logprob, n),
        top_logprobs_num=max(top_logprobs_num, 0) if return_logprob else 0,  # SGLang: <= 0 asks none
        return_sampling_mask=return_sampling_mask,
        return_text_in_logprobs=return_text_in_logprobs,
        stream=stream,
        stream_interval=params.stream_interval(),
        sampling_logprobs_mode=sampling_logprobs_mode or "selected",
    )
    return _scheduler_aborts(spec, mask_refused, logprob_start_len, limits.context_len)


class UpdateWeightFromDiskReqInput(BaseModel):
    """SGLang's ``/update_weights_from_disk`` body (managers/io_struct.py 1970-1993, defaults
    included: ``flush_cache`` true); ``weight_version`` is a string, as SGLang types it (a JSON
    number is refused as SGLang's request validation refuses it), naming an integer here. ``load_format``
    may be missing or ``"auto"`` (the only format this engine loads); ``recapture_cuda_graph`` and
    the other GPU fields are accepted and mean nothing on a CPU (SGLang recaptures only on CUDA,
    model_runner_components/weight_updater.py 247-255)."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    recapture_cuda_graph: bool = False
    torch_empty_cache: bool = False


class UpdateWeightVersionReqInput(BaseModel):
    """SGLang's ``/update_weight_version`` body (managers/io_struct.py 2155-2160): the version to
    report and stamp, a string as SGLang types it (a JSON number is refused), and whether to abort
    every request first (default true)."""

    model_config = ConfigDict(extra="allow")

    new_version: str
    abort_all_requests: bool = True


class PauseGenerationReqInput(BaseModel):
    """SGLang's ``/pause_generation`` body (managers/io_struct.py 1927-1946)."""

    model_config = ConfigDict(extra="allow")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(BaseModel):
    """SGLang's ``/continue_generation`` body (managers/io_struct.py 1949-1955; its
    ``torch_empty_cache`` means nothing on a CPU)."""

    model_config = ConfigDict(extra="allow")

    torch_empty_cache: bool = True


class AbortReq(BaseModel):
    """SGLang's ``/abort_request`` body (managers/io_struct.py 86-89, 2285-2296: ``rid`` may be
    null, read as ``""``)."""

    model_config = ConfigDict(extra="allow")

    rid: str | None = None
    abort_all: bool = False


def parse_version(value: int | str | None) -> int | None:
    """The integer weight version named by ``value`` (SGLang sends it as a string), by the fleet's
    one rule (:func:`weight_sync.types.parse_version`); :class:`RequestError` (a 400) when it names
    none."""
    try:
        return parse_weight_version(value, "weight_version")
    except InvalidVersion as exc:
        raise RequestError(f"{exc}.") from None
