"""What SGLang 0.5.23 refuses in a ``/generate`` body, as one pure check the local engine
(:mod:`engine.server.protocol`) and the router's SGLang-native ``/generate``
(:mod:`router.schemas` ``GenerateRequest``) both run, so either refuses exactly what SGLang does
in the fields the fleet sends or forwards.

SGLang judges a body in three steps (paths under ``python/sglang/`` of the released wheel):

1. FastAPI parses it into the ``GenerateReqInput`` dataclass (``srt/managers/io_struct.py``
   176-268): pydantic's lax types, except ``input_ids``, whose validator takes only a list of ints
   or of lists of ints (``srt/utils/field_validators.py`` 41-81: ``"1"`` or ``3.0`` is refused).
   A ``bool`` field refuses ``null`` (``stream`` 256, ``return_text_in_logprobs`` 247), an ``int``
   one too (``routed_experts_start_len`` 268). A refusal is a **400**
   (``srt/entrypoints/http_server.py`` 635-691).
2. The contract gate decodes the parsed JSON with the generated schema decoder
   (``http_server.py`` 928-939, ``srt/entrypoints/api_contract.py`` 12-18,
   ``api/v1/api_types.py`` 1413-1496 ``decode_GenerateRequest``): an integer is a JSON integer
   (no bool, string or float, 26-27, 59-62), a float a JSON number other than a bool (22-23,
   73-76), a boolean a JSON bool (53-56); ``input_ids`` is one list of integers or a list of such
   lists (938-939, 1029-1045); ``sampling_params`` is an object or a list of objects whose every
   key is one of SGLang's sampling parameters (1256-1321: an unknown key is refused, 97-108).
   A refusal is a **400** ``{"error": "invalid type: boolean `true`, expected i64"}``.
3. The tokenizer manager builds ``SamplingParams`` (``srt/sampling/sampling_params.py`` 140-250:
   ``null`` is the default; a temperature below 1e-6 is greedy, ``top_k = 1``; ``top_k = -1``
   the whole vocabulary), then ``normalize`` (331-380: at most 32 stop strings, 32 stop regexes
   of at most 256 bytes) and ``verify`` (252-329: the ranges below)
   (``srt/managers/tokenizer_manager.py`` 1565-1567); a ``ValueError`` is a **400**
   ``{"error": {"message": ...}}`` (``http_server.py`` 984-990, 2246-2250), or, for a
   ``"stream": true`` request, an HTTP 200 stream of one :func:`stream_error_event` and
   ``[DONE]`` (949-979). SGLang checks the server-dependent fields (LoRA, ``input_embeds``, the
   context length, hidden states, ...) before an item's ``SamplingParams``: a caller that judges
   those runs step 3 itself (``through="gate"``, then :func:`batch_refusal`,
   :func:`short_list_refusal` and :func:`item_refusal` in SGLang's order); one that does not
   (the router, which forwards the body) gets no step-3 refusal SGLang would make only after
   such a field: the server names what it names first.

Each step answers its own body shape (:class:`Refusal`, :func:`error_body`): step 1 through the
``RequestValidationError`` handler, ``ErrorResponse(message, type="Bad Request", code=400)``
dumped (``{"object": "error", "message", "type", "param": null, "code": 400}``, the handler's
format for ``/generate``: only ``/v1/messages``, ``/v1/systemone`` and ``/v1/responses`` get
others; ``http_server.py`` 635-691, ``entrypoints/openai/protocol.py`` 106-111); step 2 the gate's bare
string ``{"error": "<text>"}`` (``generate_request``, ``http_server.py`` 928-939); step 3
``{"error": {"message": ...}}``.

:func:`generate_body_error` returns the first refusal as one line naming the field (``stream:
invalid type: integer `1`, expected a boolean``; ``sampling_params[1].top_k: ...``; a range in
SGLang's own words, which name the field: ``top_p must be in (0, 1], got 1.5.``), or None. It
checks the fields the fleet sends or forwards (``text``, ``input_ids``, ``rid``, ``stream``,
``sampling_params``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
``token_ids_logprob``, ``return_text_in_logprobs``, ``return_sampling_mask``,
``routed_experts_start_len``) and the other top-level keys the gate decodes, as it types them
(``return_hidden_states``, the ``bootstrap_*`` keys, ``decode_tp_size``, ``routed_dp_rank``,
``disagg_prefill_dp_rank``, ``mm_hashes``, ``extra_key``, ``priority``, ``cache_salt``,
``require_reasoning``, ``lora_path``, ``session_params``, ``routing_key``,
``max_thinking_tokens``, ``session_id``, ``custom_logit_processor``, ``custom_labels``,
``return_prompt_token_ids``, ``modalities``) and the nested structs (``image_data``,
``video_data``, ``audio_data``: ``MediaInput``, api_types.py 2034-2043, 1902-1991; ``kv_hints``:
``KvHintsEnvelopeOrList``, 1598-1660; ``images_config``: ``ImagesConfig``, 1579-1587), as it types
them, and ``return_indexer_topk``, a dataclass-only bool (io_struct.py 269), and
``mm_content_hashes``, dataclass-only optional strings or lists of them (219-221), as the parse
types them. Every field is typed as the dataclass types it, whose parse runs first: a value pydantic's lax
type refuses too (a number for a string field, ``2`` for a bool, ``1.5`` for an int, a scalar for
a list) is the parse's refusal, one only the gate refuses (``1`` for a bool, ``"3"`` for an int)
the gate's (the parse takes any media value, ``kv_hints`` a dict or a list of dicts and nulls,
``images_config`` a dict: io_struct.py 78-81, 158-204, 357, 378-380); and each step judges the
whole body before the next (a field the parse refuses is the answer wherever it stands in the
body, then the gate's first, then step 3's). Step 3 runs in SGLang's order
(:func:`tokenizer_refusal`): ``normalize_batch_and_arguments`` (no input, :data:`NO_INPUT`;
``session_id`` with ``session_params``, :data:`SESSION_BOTH`; a batch's ``image_data``,
``watermark``, ``return_hidden_states``, ``extra_key`` and ``cache_salt`` lengths; ``kv_hints``,
decoded with msgspec, in its words: ``Malformed kv_hints envelope: ...``), a batch's short
per-item list (:data:`PER_ITEM_LISTS`, :data:`NO_SHORT_LIST`) or one request's ``rid`` list
(:data:`NO_RID_LIST`) in ``_init_req_state``, then each item: a watermark set both ways, a ``choice``
(:data:`NO_CHOICE`), a malformed watermark (:func:`watermark_malformed`), then ``SamplingParams``'
ranges, so a malformed ``watermark`` is named before an out-of-range ``top_p``
(tokenizer_manager.py 1553-1567). What SGLang answers with a 500 is refused here as a 400 naming
it (:attr:`Refusal.fails`), so the router refuses it too (a 422) instead of failing over as from a
failing replica. Not
checked here: the other dataclass-only keys, and what needs the server's settings (a watermark the
server must enable, ``resolve_watermark_request``; a ``lora_path``, ``max_thinking_tokens``, a
``routed_dp_rank`` other than 0, and per item ``input_embeds``, hidden states and a custom logit
processor, after which the full check makes no refusal SGLang makes later:
:func:`_server_judges`).
An **unknown** top-level key is no refusal: the dataclass parse ignores it (a stdlib dataclass,
pydantic's ``extra="ignore"``, ``io_struct.py`` 176-178) and the gate skips it
(``decode_GenerateRequest`` has no ``else``, ``api_types.py`` 1413-1496). What needs the model (a
token id's vocabulary range, ``logit_bias`` keys) is the engine's to check.

The modules, each importing only those before it: :mod:`~core.sglang_contract.refusal` (a
refusal and each step's body), :mod:`~core.sglang_contract.values` (the parse's and the gate's
value types), :mod:`~core.sglang_contract.sampling` (``sampling_params``: types, ranges, the
watermark, one item's step 3), :mod:`~core.sglang_contract.fields` (the top-level fields and
nested structs), :mod:`~core.sglang_contract.normalize` (step 3 of the whole request, in
SGLang's order), :mod:`~core.sglang_contract.body` (the one check of a body).
"""

from core.sglang_contract.body import generate_body_error, generate_body_refusal
from core.sglang_contract.normalize import (
    NO_INPUT,
    NO_LIST_FOR_ONE,
    NO_LOGPROB_START_BELOW,
    NO_NULL_N,
    NO_ONE_VALUE_LIST,
    NO_RID_LIST,
    NO_SHORT_LIST,
    NO_TEXT_AND_IDS,
    ONE_VALUE_FIELDS,
    PER_ITEM_LISTS,
    SESSION_BOTH,
    batch_refusal,
    item_refusal,
    list_for_one_refusal,
    scheduler_failure_refusal,
    short_list_refusal,
)
from core.sglang_contract.refusal import ContractError, Refusal, Step, error_body, stream_error_event
from core.sglang_contract.sampling import (
    MAX_STOP_COUNT,
    MAX_STOP_REGEX_COUNT,
    MAX_STOP_REGEX_LEN,
    NO_CHOICE,
    SAMPLING_EPS,
    SAMPLING_FIELDS,
    TOP_K_ALL,
    WATERMARK_BOTH,
    max_new_tokens_bound,
    sampling_params,
    watermark_malformed,
)
from core.sglang_contract.values import int_list, token_ids

__all__ = [
    "ContractError",
    "MAX_STOP_COUNT",
    "MAX_STOP_REGEX_COUNT",
    "MAX_STOP_REGEX_LEN",
    "NO_CHOICE",
    "NO_INPUT",
    "NO_LIST_FOR_ONE",
    "NO_LOGPROB_START_BELOW",
    "NO_NULL_N",
    "NO_ONE_VALUE_LIST",
    "NO_RID_LIST",
    "NO_SHORT_LIST",
    "NO_TEXT_AND_IDS",
    "ONE_VALUE_FIELDS",
    "PER_ITEM_LISTS",
    "Refusal",
    "SAMPLING_EPS",
    "SAMPLING_FIELDS",
    "SESSION_BOTH",
    "Step",
    "TOP_K_ALL",
    "WATERMARK_BOTH",
    "batch_refusal",
    "error_body",
    "generate_body_error",
    "generate_body_refusal",
    "int_list",
    "item_refusal",
    "list_for_one_refusal",
    "max_new_tokens_bound",
    "scheduler_failure_refusal",
    "sampling_params",
    "short_list_refusal",
    "stream_error_event",
    "token_ids",
    "watermark_malformed",
]
