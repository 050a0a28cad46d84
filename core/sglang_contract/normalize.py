"""Step 3 of the package docstring for the whole request, in SGLang 0.5.23's order:
``normalize_batch_and_arguments``, ``_init_req_state``, then each item; what SGLang answers with a
500 is refused here as a 400 naming it (``Refusal.fails``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from core.sglang_contract.fields import KV_HINT_ACTION_FIELDS
from core.sglang_contract.refusal import ContractError, Refusal
from core.sglang_contract.sampling import item_sampling_refusal

NO_SHORT_LIST = (
    "SGLang 0.5.23 takes one entry per item of a batch (managers/io_struct.py 540, 635-642, 722-747, "
    "776-848, 959-1031), and its /generate fails on a shorter list (an IndexError, a 500)."
)
"""Why a batch's per-item list shorter than the batch (:data:`PER_ITEM_LISTS`), or an empty
``sampling_params`` list, is refused: ``_handle_parallel_sampling`` reads a list's first entry
(``io_struct.py`` 540); ``_normalize_lora_paths``, ``_normalize_video_data`` /
``_normalize_audio_data`` / ``_normalize_sampling_params``, ``_normalize_logprob_params``,
``_normalize_custom_logit_processor`` and ``_normalize_bootstrap_params`` keep a list as it is
(635-642, 722-747, 776-821, 839-848, 907-947; only ``image_data``, ``watermark``,
``return_hidden_states``, ``extra_key``, ``cache_salt``, ``kv_hints`` and the rids are
length-checked), then each item's sub-request indexes it (``__getitem__``, 959-1031): an
IndexError, which ``/generate`` does not catch (``http_server.py`` 983-990 catch ``ValueError``):
a 500, which the router would take for a failing replica; refused here as a 400, in step 3's
body, by the engine and the router alike. A longer list is served: its extra entries are never
read."""


PER_ITEM_LISTS = (
    "video_data", "audio_data", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "lora_path", "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size",
)  # fmt: skip
"""A batch's lists SGLang 0.5.23 does not length-check and indexes per item, in
``__getitem__``'s order (``io_struct.py`` 959-1031): shorter than the batch, :data:`NO_SHORT_LIST`;
longer, the extra entries ignored. ``token_ids_logprob`` is one only as a list of lists (an
empty list asks for none, a flat one is every item's: 809-821, :func:`_per_item_list`)."""


NO_TEXT_AND_IDS = (
    "SGLang 0.5.23 takes a request's shape from text and each item's tokens from input_ids when both "
    "are sent (managers/io_struct.py 444-455, 479-487, 969; managers/tokenizer_manager.py 1118), and "
    "its /generate fails on input_ids that do not give one row per text (an IndexError or a "
    "TypeError, a 500)."
)
"""Why ``text`` with ``input_ids`` of another shape is refused: ``_validate_inputs`` refuses
only all of ``text``, ``input_ids`` and ``input_embeds`` (``io_struct.py`` 444-455),
``_determine_batch_size`` reads ``text`` first (479-487), each sub-request takes
``input_ids[i]`` (969) and ``_tokenize_one_request`` tokenizes nothing when ``input_ids`` is set
(``tokenizer_manager.py`` 1118). A text list with fewer rows is an IndexError in
``_init_req_state``; a flat list for a text list, or rows for one text, a TypeError when the
item is tokenized (``len``, 1336; ``array("q", ...)``, 1543-1545), which this check makes with
the short lists (:func:`_init_refusal`). A 500, which the router would take for a failing
replica; refused here as a 400, in step 3's body, by the engine and the router alike."""


def _text_and_ids_refusal(body: dict[str, Any]) -> ContractError | None:
    """``text`` sent with ``input_ids`` that do not give one row per text (:data:`NO_TEXT_AND_IDS`),
    or None; matching ones are served from ``input_ids``."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None or ids is None:
        return None
    rows = type(ids) is list and bool(ids) and type(ids[0]) is list
    if type(text) is list and (not rows or len(ids) < len(text)):
        shape = f"{len(ids)} rows" if rows else "one list of ids"
        message = f"input_ids ({shape}) for a batch of {len(text)} texts: {NO_TEXT_AND_IDS}"
    elif type(text) is str and rows:
        message = f"input_ids ({len(ids)} rows) for one text: {NO_TEXT_AND_IDS}"
    else:
        return None
    return ContractError(message, step="verify", value=ids, fails=True)


def _msgspec_type(v: Any) -> str:
    """The type as msgspec names it in a ``ValidationError``."""
    if v is None:
        return "null"
    names = {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}
    return names.get(type(v), type(v).__name__)


def _kv_hints_malformed(v: dict[str, Any]) -> str | None:
    """``decode_kv_hints_envelope`` (``srt/managers/kv_hints.py`` 44-58: ``msgspec.convert`` into
    ``KvHintsEnvelope``, 16-41) on an envelope the gate took, in msgspec's words: ``actions``
    null, a ``payload`` that is not an object, a required field missing (the actions', as each
    is converted, then the envelope's), or None."""
    if "actions" in v:
        actions = v["actions"]
        if actions is None:
            return "Expected `array`, got `null` - at `$.actions`"
        for i, action in enumerate(actions):
            payload = action.get("payload", {})
            if type(payload) is not dict:
                return f"Expected `object`, got `{_msgspec_type(payload)}` - at `$.actions[{i}].payload`"
            for name in KV_HINT_ACTION_FIELDS:
                if name not in action:
                    return f"Object missing required field `{name}` - at `$.actions[{i}]`"
    for name in ("protocol_version", "message_id"):
        if name not in v:
            return f"Object missing required field `{name}`"
    return None


def _kv_hints_refusal(v: Any, batch: int | None) -> str | None:
    """``kv_hints`` as ``normalize_batch_and_arguments`` judges it (``io_struct.py`` 583-587 for
    one request: no list, an envelope only if truthy; 888-905 for a batch: one per item, each
    truthy one decoded, and a dict always), each envelope by :func:`_kv_hints_malformed`."""
    if v is None:
        return None
    if batch is None:
        if type(v) is list:
            return "kv_hints should be a single envelope for one request."
        envelopes = [v] if v else []
    elif type(v) is list:
        if len(v) != batch:
            return "The length of kv_hints should be equal to the batch size."
        envelopes = [x for x in v if x]
    else:
        envelopes = [v]
    for envelope in envelopes:
        refused = _kv_hints_malformed(envelope)
        if refused is not None:
            return f"Malformed kv_hints envelope: {refused}"
    return None


def _batch_size(body: dict[str, Any]) -> int | None:
    """The batch's size, or None for one request (``_determine_batch_size``, ``io_struct.py``
    473-498: a list ``text``, or ``input_ids`` whose first entry is no integer)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:
        return len(text) if type(text) is list else None
    if type(ids) is list and ids and type(ids[0]) is list:
        return len(ids)
    return None


NO_LIST_FOR_ONE = (
    "SGLang 0.5.23 reads one request's sampling_params as an object (managers/tokenizer_manager.py "
    "1354: sampling_params.get), and its /generate fails on a list there (an AttributeError, a 500); "
    "send an object, or a list with a batch."
)
"""Why a list ``sampling_params`` on one request (not a batch, no ``n`` above 1) is refused:
``_handle_parallel_sampling`` reads its first entry and keeps the request single
(``io_struct.py`` 531-557), ``_normalize_single_inputs`` keeps the list (559-562), and
``_validate_one_request`` calls ``.get`` on it after the input's length check
(``tokenizer_manager.py`` 1339-1354): an AttributeError, which ``/generate`` does not catch
(``http_server.py`` 983-990), a 500 the router would take for a failing replica; refused here
as a 400, in step 3's body, at that place (:func:`list_for_one_refusal`)."""


NO_NULL_N = (
    "SGLang 0.5.23 compares sampling_params.n with 1 (managers/io_struct.py 531-557: "
    "parallel_sample_num > 1), and its /generate fails on a null there (a TypeError, a 500); "
    "leave n out or send an integer."
)
"""Why ``"n": null`` is refused (unless ``beam_width`` above 1 sets the count to 1 first,
``io_struct.py`` 517-529): ``_handle_parallel_sampling`` takes ``get("n", 1)``, ``None``, and
compares it with 1, a TypeError in ``normalize_batch_and_arguments``: a 500."""


def _parallel_sampling_refusal(params: Any) -> ContractError | None:
    """``_handle_parallel_sampling`` (``io_struct.py`` 531-557) on a non-empty
    ``sampling_params``: a list whose entries' ``n`` differ (its words), then a null ``n``
    (:data:`NO_NULL_N`)."""
    if type(params) is dict:
        rows = [params]
    elif type(params) is list and params:
        rows = params
    else:
        return None
    n = rows[0].get("n", 1)
    if any(row.get("n", 1) != n for row in rows):
        message = "The parallel_sample_num should be the same for all samples in sample params."
        return ContractError(message, step="verify")
    if n is None and (rows[0].get("beam_width") or 1) <= 1:
        return ContractError(f"sampling_params.n is null: {NO_NULL_N}", step="verify", value=n, fails=True)
    return None


def _parallel_count(body: dict[str, Any]) -> int:
    """``parallel_sample_num``: ``sampling_params.n`` (its first entry's, in a list) where above 1
    it makes parallel samples, else 1 (``_handle_parallel_sampling``, ``io_struct.py`` 531-557;
    ``beam_width`` above 1 sets the count to 1 first, 517-529)."""
    params = body.get("sampling_params")
    first = params[0] if type(params) is list and params else params if type(params) is dict else {}
    n = first.get("n", 1)
    return n if type(n) is int and n > 1 and (first.get("beam_width") or 1) <= 1 else 1


def _parallel(body: dict[str, Any]) -> bool:
    """Whether ``sampling_params.n`` above 1 makes parallel samples (:func:`_parallel_count`)."""
    return _parallel_count(body) > 1


def _stays_single(body: dict[str, Any]) -> bool:
    """Whether the request stays one request: no batch (:func:`_batch_size`), and no parallel
    samples (:func:`_parallel`), which make one request a batch of one (``io_struct.py``
    548-557)."""
    return _batch_size(body) is None and not _parallel(body)


def _normalized_batch(body: dict[str, Any]) -> int | None:
    """The ``batch_size`` ``_normalize_batch_inputs`` judges a batch's lists by (``io_struct.py``
    589-612), or None for a request that stays single (``_normalize_single_inputs``, 559-587):
    a batch's size, or 1 for one request that parallel samples make a batch (548-557)."""
    batch = _batch_size(body)
    return batch if batch is not None else None if _stays_single(body) else 1


def _listed_for_one(body: dict[str, Any], key: str, why: str) -> ContractError | None:
    """A list at ``key`` on a request that stays single (:func:`_stays_single`), which SGLang keeps
    as the request's one value and fails on (``why``, its :data:`NO_LIST_FOR_ONE`-like reason), or
    None."""
    value = body.get(key)
    if type(value) is not list or not _stays_single(body):
        return None
    return ContractError(f"{key} is a list for one request: {why}", step="verify", value=value, fails=True)


def _list_for_one(body: dict[str, Any]) -> ContractError | None:
    """A non-empty list ``sampling_params`` on a request that stays single (:data:`NO_LIST_FOR_ONE`;
    an empty one is a short list, :data:`NO_SHORT_LIST`)."""
    return _listed_for_one(body, "sampling_params", NO_LIST_FOR_ONE) if body.get("sampling_params") else None


NO_RID_LIST = (
    "SGLang 0.5.23 keeps one request's rid as sent (managers/io_struct.py 559-564) and looks it up "
    "among the requests it runs (managers/tokenizer_manager.py 3817-3818, 3835), and its /generate "
    "fails on a list there (a TypeError: a list is unhashable, a 500); send a string, or a list with "
    "a batch."
)
"""Why a ``rid`` list on a request that stays single is refused: ``_normalize_single_inputs``
sets a rid only when none was sent (``io_struct.py`` 559-564), ``_validate_rid_uniqueness``
refuses only one named twice (390-397), and ``_init_req_state`` tests ``rid in
self.rid_to_state`` (``tokenizer_manager.py`` 3835), a TypeError on a list, which ``/generate``
does not catch (``http_server.py`` 983-990): a 500, which the router would take for a failing
replica; refused here as a 400, in step 3's body, at that place (:func:`_init_refusal`)."""


def _rid_list_for_one(body: dict[str, Any]) -> ContractError | None:
    """A ``rid`` list on a request that stays single (:data:`NO_RID_LIST`), or None."""
    return _listed_for_one(body, "rid", NO_RID_LIST)


ONE_VALUE_FIELDS = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
    "sampling_logprobs_mode",
)  # fmt: skip
"""One request's fields SGLang 0.5.23's scheduler reads as one value (:data:`NO_ONE_VALUE_LIST`)."""


NO_ONE_VALUE_LIST = (
    "SGLang 0.5.23 keeps one request's list here as sent (managers/io_struct.py 559-574) and its "
    "scheduler reads it as one value (managers/scheduler.py 3256-3275: compared with -1 and with the "
    "input's length; a list that holds false is true), where a TypeError ends the scheduler process "
    "and the server with it (6360-6373); send one value, or a list with a batch."
)
"""Why a list at one of :data:`ONE_VALUE_FIELDS` on a request that stays single is refused: the
gate takes it (a bool/int/string or a list of them), ``_normalize_single_inputs`` fills in only a
missing value (``io_struct.py`` 559-574), the tokenizer manager reads ``return_sampling_mask`` for
its truth only (``tokenizer_manager.py`` 1420-1435), and the scheduler compares
``logprob_start_len`` with numbers (``scheduler.py`` 3256-3275): a TypeError in
``_handle_generate_request`` (2959, dispatched uncaught at 2253), which ends the scheduler's event
loop and signals the server to quit (6360-6373), so the replica is gone, not one request refused.
A list SGLang would serve (an empty ``return_logprob``, read as false) is refused too: what it
does with each such list is decided deep in the scheduler, and a body that may end a replica is
never forwarded. Refused here as a 400 naming the field, after everything SGLang refuses before
its scheduler, and also where the full check leaves the rest to the server
(:func:`tokenizer_refusal`)."""


def _one_value_list(body: dict[str, Any]) -> ContractError | None:
    """A list at one of :data:`ONE_VALUE_FIELDS` on a request that stays single
    (:data:`NO_ONE_VALUE_LIST`), or None."""
    listed = (_listed_for_one(body, key, NO_ONE_VALUE_LIST) for key in ONE_VALUE_FIELDS)
    return next((refused for refused in listed if refused is not None), None)


NO_LOGPROB_START_BELOW = (
    "SGLang 0.5.23's scheduler keeps a logprob_start_len below -1 as sent when return_logprob is "
    "true (managers/scheduler.py 3256-3273), computes input log-probs from the cached prefix's end "
    "(managers/schedule_batch.py 1774-1775, 2430-2435), takes the input's ids from it as a Python "
    "index from the end (managers/scheduler_components/logprob_result_processor.py 50, 164) and "
    "asserts that the two are as many (295-297): an AssertionError unless the prompt is no longer "
    "than -logprob_start_len and no cached prefix matched, which ends the scheduler process and the "
    "server with it (managers/scheduler.py 6360-6373); send -1, or a start from 0 to the input's length."
)
"""Why a ``logprob_start_len`` below -1 on an item that asks for log-probs is refused: the
scheduler ignores the start only without ``return_logprob`` (``scheduler.py`` 3256-3258) and
aborts only one above the input's length (3275-3279); below -1 the prefix match is not capped
(``schedule_batch.py`` 1774-1775: only a start from 0 caps it), the input log-probs run from the
prefix's end (2430-2435: ``max(start, prefix_len)``), while their ids are
``origin_input_ids[start:]``, the last ``-start`` ids (``logprob_result_processor.py`` 50, 164);
the length assertions (295-297) fail unless both counts agree, which a cached prefix (another
request with the same prompt) or a prompt longer than ``-start`` breaks. The AssertionError, in
the scheduler's output processing, ends its event loop and the server (``scheduler.py``
6360-6373). Whether it is served depends on the cache, which no caller can see: refused here as
a 400 naming it, with the scheduler's other failures (:func:`scheduler_failure_refusal`)."""


def _logprob_start_below(body: dict[str, Any]) -> ContractError | None:
    """The first item that asks for log-probs with a ``logprob_start_len`` below -1
    (:data:`NO_LOGPROB_START_BELOW`), or None; a batch's lists give each item its entry
    (``io_struct.py`` 776-807: one value is every item's, null the defaults, false and -1; a short
    list's missing entries are another refusal's, :data:`NO_SHORT_LIST`)."""
    batch = _batch_size(body)
    for i in range(1 if batch is None else batch):
        asks = _item_value(body.get("return_logprob"), i, batch)
        start = _item_value(body.get("logprob_start_len"), i, batch)
        if asks is True and type(start) is int and start < -1:
            where = "" if batch is None else f" (item {i})"
            message = f"logprob_start_len={start} with return_logprob{where}: {NO_LOGPROB_START_BELOW}"
            return ContractError(message, step="verify", value=start, fails=True)
    return None


def _item_value(value: Any, i: int, batch: int | None) -> Any:
    """Item ``i``'s value of a field a batch may list one per item (a list on one request is
    another refusal's, :data:`NO_ONE_VALUE_LIST`: read as none)."""
    if type(value) is not list:
        return value
    return value[i] if batch is not None and i < len(value) else None


def _scheduler_failure(body: dict[str, Any]) -> ContractError | None:
    """What SGLang's scheduler fails on, ending the server, in its order (``scheduler.py``
    3256-3279): a list where one request's scheduler reads one value (:data:`NO_ONE_VALUE_LIST`),
    then a ``logprob_start_len`` below -1 with ``return_logprob``
    (:data:`NO_LOGPROB_START_BELOW`); or None."""
    return _one_value_list(body) or _logprob_start_below(body)


def scheduler_failure_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal of what SGLang's scheduler fails on (:func:`_scheduler_failure`), or None; a
    caller that makes SGLang's other step-3 checks runs this after all of them."""
    refused = _scheduler_failure(body)
    return None if refused is None else Refusal.of(refused)


def list_for_one_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal of a list ``sampling_params`` on one request (:data:`NO_LIST_FOR_ONE`), or None;
    SGLang fails on it per item after the input's length check and before the requested total's
    (``tokenizer_manager.py`` 1339-1354), so a caller that makes those checks runs this between."""
    refused = _list_for_one(body)
    return None if refused is None else Refusal.of(refused)


def _short(key: str, value: list[Any], batch: int) -> ContractError:
    message = f"{key} has {len(value)} entries for a batch of {batch}: {NO_SHORT_LIST}"
    return ContractError(message, step="verify", value=value, fails=True)


def tokenizer_refusal(body: dict[str, Any]) -> ContractError | None:
    """Step 3 on a body both earlier steps took, in SGLang's order (``generate_request``,
    ``tokenizer_manager.py`` 903-942): :func:`_normalize_refusal`, then :func:`_init_refusal`,
    then each item in turn (:func:`item_sampling_refusal` via :func:`_items`). Where SGLang would first
    judge a field by the server's settings (:func:`_server_judges`: ``max_thinking_tokens`` and
    ``routed_dp_rank`` before the rids are registered, the LoRA adapters after, then per item
    ``input_embeds``, hidden states, the custom logit processor), this check stops there and
    returns None: what SGLang names then is the server's to say, so a caller that forwards the
    body (the router) gets SGLang's own answer, naming what SGLang names (a ``lora_path`` before
    an out-of-range ``top_p``). Last, and also where it stopped so, what the scheduler fails on
    (:func:`_scheduler_failure`): a body that may end the replica is refused whatever the server
    would have named first."""
    refused = _before_the_scheduler(body)
    return refused if refused is not None else _scheduler_failure(body)


def _before_the_scheduler(body: dict[str, Any]) -> ContractError | None:
    """:func:`tokenizer_refusal` but for what only the scheduler fails on; None also where it
    stops for a field the server judges."""
    refused = _normalize_refusal(body)
    if refused is not None or _server_judges(body, _SERVER_BEFORE_RIDS):
        return refused
    refused = _init_refusal(body)
    if refused is not None or _server_judges(body, ("lora_path",)):
        return refused
    for i, (where, p, top) in enumerate(_items(body)):
        if _server_judges(body, ("input_embeds",), i):
            return None
        refused = _list_for_one(body)  # after the input's length, which needs the model
        if refused is not None or _server_judges(body, _SERVER_PER_ITEM, i):
            return refused
        refused = item_sampling_refusal(where, p, top)
        if refused is not None:
            return refused
    return None


_SERVER_BEFORE_RIDS = ("max_thinking_tokens", "routed_dp_rank", "data_parallel_rank")
"""What ``generate_request`` judges by the server's settings before ``_init_req_state``
(``tokenizer_manager.py`` 905-924: strict thinking, the data-parallel size)."""


_SERVER_PER_ITEM = ("token_ids_logprob", "return_hidden_states", "custom_logit_processor")
"""What ``_tokenize_one_request`` judges by the server's settings or model after the input's
length and before the item's ``SamplingParams`` (``tokenizer_manager.py`` 1393-1419: the
vocabulary, 1513-1531, the hidden-states mode, ``--enable-custom-logit-processor``);
``input_embeds`` (the radix cache, 1109-1114) comes before the input's length."""


def _asks(key: str, v: Any) -> bool:
    """Whether ``v`` at ``key`` asks the server for anything it judges by its settings (SGLang's
    tests: ``is not None`` for ``max_thinking_tokens`` and ``input_embeds``, 905, 1109; a rank
    other than 0, which every server's range holds, 915-924; ``if value:`` for ``lora_path`` and
    ``custom_logit_processor``, 3726, 1413; a hidden-states mode other than none, 1394-1398)."""
    if key in ("max_thinking_tokens", "input_embeds"):
        return v is not None
    if key in ("routed_dp_rank", "data_parallel_rank"):
        return v not in (None, 0)
    if key == "return_hidden_states":
        return v not in (None, False)
    return bool(v)


def _server_judges(body: dict[str, Any], keys: tuple[str, ...], item: int | None = None) -> bool:
    """Whether any of ``keys`` in ``body`` asks what SGLang judges by the server's settings
    (:func:`_asks`); with ``item``, as that item of a batch has it (a batch's list has one per
    item, ``io_struct.py`` 972-1000)."""
    for key in keys:
        v = body.get(key)
        if item is not None and _batch_size(body) is not None and _per_item_list(key, v):
            v = v[item] if item < len(v) else None
        if _asks(key, v):
            return True
    return False


def _per_item_list(key: str, v: Any) -> bool:
    """Whether a batch's ``v`` at ``key`` is one entry per item (``io_struct.py`` 809-821, 972-1000):
    a list, but for ``token_ids_logprob`` only a list of lists (one list of ids is every item's),
    and never ``input_embeds`` (the batch's input itself)."""
    if type(v) is not list or key == "input_embeds":
        return False
    return key != "token_ids_logprob" or (bool(v) and type(v[0]) is list)


NO_INPUT = "Either text, input_ids or input_embeds should be provided."
"""``_validate_inputs`` (``io_struct.py`` 444-455, the first check of
``normalize_batch_and_arguments``, 431): none of ``text``, ``input_ids``, ``input_embeds`` sent
(or null), or all three; a ``ValueError``, a 400 in step 3's body."""


def _inputs_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_validate_inputs`` (:data:`NO_INPUT`): no input, or all three inputs, or None."""
    sent = [body.get(key) is not None for key in ("text", "input_ids", "input_embeds")]
    if not any(sent) or all(sent):
        return ContractError(NO_INPUT, step="verify")
    return None


def _empty_ids_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_determine_batch_size`` (``io_struct.py`` 479-498): without ``text``, an empty
    ``input_ids`` is refused in its words (488-497) unless ``session_params`` names a session
    (``id``), whose history may supply the prompt; or None."""
    if body.get("text") is not None or body.get("input_ids") != []:
        return None
    session = body.get("session_params")
    if type(session) is dict and session.get("id"):
        return None
    return ContractError("input_ids cannot be empty.", step="verify", value=[])


SESSION_BOTH = "session_id and session_params cannot both be set."
"""``normalize_batch_and_arguments`` (``io_struct.py`` 433-434), after ``_determine_batch_size``
and before ``_handle_parallel_sampling``: both sent (not null), whatever their values."""


def _normalize_refusal(body: dict[str, Any]) -> ContractError | None:
    """``normalize_batch_and_arguments`` (``tokenizer_manager.py`` 903; ``io_struct.py`` 406-442),
    in its order: the inputs (:func:`_inputs_refusal`, 431), an empty ``input_ids``
    (:func:`_empty_ids_refusal`, 432), ``session_id`` with ``session_params``
    (:data:`SESSION_BOTH`, 433-434); an empty ``sampling_params`` list (read at its first entry,
    540: :data:`NO_SHORT_LIST`), ``n`` (:func:`_parallel_sampling_refusal`); for a batch, or one
    request parallel samples make a batch of one (:func:`_normalized_batch`), its lists
    (:func:`_batch_lists_refusal`), else one request's keys (:func:`_single_refusal`);
    ``kv_hints`` (583-587, 888-905); last a rid named twice (:func:`_rid_uniqueness_refusal`)."""
    refused = _inputs_refusal(body) or _empty_ids_refusal(body)
    if refused is not None:
        return refused
    if body.get("session_id") is not None and body.get("session_params") is not None:
        return ContractError(SESSION_BOTH, step="verify")
    params, rid = body.get("sampling_params"), body.get("rid")
    if params == []:
        return _short("sampling_params", params, _batch_size(body) or 1)
    refused = _parallel_sampling_refusal(params)
    if refused is not None:
        return refused
    batch = _normalized_batch(body)
    refused = _single_refusal(body) if batch is None else _batch_lists_refusal(body, batch)
    if refused is not None:
        return refused
    kv_hints = _kv_hints_refusal(body.get("kv_hints"), batch)
    if kv_hints is not None:
        return ContractError(kv_hints, step="verify")
    return _rid_uniqueness_refusal(rid)


_PARALLEL_LISTS = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
    "sampling_logprobs_mode", "token_ids_logprob",
)  # fmt: skip
"""The per-item lists ``_normalize_logprob_params`` refuses with parallel samples, in its order
(``io_struct.py`` 776-821: any list, ``token_ids_logprob`` only a list of lists)."""


def _parallel_list_refusal(body: dict[str, Any], keys: tuple[str, ...]) -> ContractError | None:
    """With parallel samples (:func:`_parallel`), the first of ``keys`` sent as one entry per
    item (:func:`_per_item_list`; an empty list too, but for ``token_ids_logprob``), refused in
    SGLang's words (``io_struct.py`` 783-788, 817-821, 839-848), or None."""
    if not _parallel(body):
        return None
    for key in keys:
        if _per_item_list(key, body.get(key)):
            message = f"Cannot use list {key} with parallel_sample_num > 1"
            return ContractError(message, step="verify", value=body.get(key))
    return None


def _batch_lists_refusal(body: dict[str, Any], batch: int) -> ContractError | None:
    """``_normalize_batch_inputs`` (``io_struct.py`` 589-612) on a batch of ``batch``
    (:func:`_normalized_batch`), in its order: a ``rid`` list of another length (759-774), the
    length of ``image_data`` (659-662; an empty list is none), ``mm_hashes``
    (:func:`_mm_hashes_refusal`), the length of the top-level ``watermark`` (749-757), with
    parallel samples a per-item logprob list (:data:`_PARALLEL_LISTS`), the length of
    ``return_hidden_states`` (823-837), with parallel samples a ``custom_logit_processor`` list
    (839-848), the lengths of ``extra_key`` and ``cache_salt`` (850-886); or None."""
    rid = body.get("rid")
    if type(rid) is list and len(rid) != batch:
        message = "The specified rids length mismatch with the batch_size for batch processing."
        return ContractError(message, step="verify", value=rid)
    return (
        _lengths_refusal(body, batch, ("image_data",))
        or _mm_hashes_refusal(body, batch)
        or _lengths_refusal(body, batch, ("watermark",))
        or _parallel_list_refusal(body, _PARALLEL_LISTS)
        or _lengths_refusal(body, batch, ("return_hidden_states",))
        or _parallel_list_refusal(body, ("custom_logit_processor",))
        or _lengths_refusal(body, batch, ("extra_key", "cache_salt"))
    )


def _image_counts(image_data: Any, batch: int) -> list[int]:
    """How many images each of a batch's requests has once ``_normalize_image_data`` normalized
    ``image_data`` (``io_struct.py`` 645-685, its length already checked): none for null or an
    empty list, one each for one image or a flat list (a null entry too, wrapped as ``[None]``),
    each row's length for a list of lists (a null row none)."""
    if image_data is None or image_data == []:
        return [0] * batch
    if type(image_data) is not list:
        return [1] * batch
    if type(image_data[0]) is list:
        return [len(row or []) for row in image_data]
    return [1] * len(image_data)


def _mm_hashes_refusal(body: dict[str, Any], batch: int) -> ContractError | None:
    """``_normalize_mm_hashes`` (``io_struct.py`` 687-720) on a batch's ``mm_hashes`` (a list:
    the gate's ``StringListOrList``), then its ``mm_content_hashes`` (a list: the dataclass
    parse's type, 219-221), each in its words: another length than the batch (696-699), then per
    request a hash that is no list for a request without exactly one image (705-713), or a list
    of another length than its images (714-718); or None. (One request's are judged only by a
    multimodal processor, which a text-only model has none of: ``tokenizer_manager.py`` 1159-1175,
    1240-1242.)"""
    counts = _image_counts(body.get("image_data"), batch)
    for field in ("mm_hashes", "mm_content_hashes"):
        hashes = body.get(field)
        if hashes is None:
            continue
        if len(hashes) != batch:
            message = f"The length of {field} should equal the batch size"
            return ContractError(message, step="verify", value=hashes)
        for i, (request_hashes, count) in enumerate(zip(hashes, counts, strict=True)):
            if type(request_hashes) is not list and count != 1:
                message = f"{field}[{i}] must be a list with one entry per image"
                return ContractError(message, step="verify", value=request_hashes)
            size = len(request_hashes) if type(request_hashes) is list else 1
            if size != count:
                message = f"{field}[{i}] has {size} entries for {count} images"
                return ContractError(message, step="verify", value=request_hashes)
    return None


def _single_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_normalize_single_inputs`` (``io_struct.py`` 559-587) on a request that stays single
    (:func:`_normalized_batch`), before its ``kv_hints`` (:func:`_kv_hints_refusal`): an
    ``extra_key`` or ``cache_salt`` that is no string (a list: the gate takes only a string or
    strings), in its words (575-580); or None."""
    for key in ("extra_key", "cache_salt"):
        value = body.get(key)
        if value is not None and type(value) is not str:
            message = f"{key} should be a string for a single request."
            return ContractError(message, step="verify", value=value)
    return None


def _lengths_refusal(body: dict[str, Any], batch: int, keys: tuple[str, ...]) -> ContractError | None:
    """The first of ``keys`` sent as a list of another length than ``batch``, in SGLang's words
    (``io_struct.py`` 659-662, 749-757, 823-837, 850-886; an empty ``image_data`` is none), or
    None."""
    for key in keys:
        value = body.get(key)
        if type(value) is list and (value or key != "image_data") and len(value) != batch:
            return ContractError(f"The length of {key} should be equal to the batch size.", step="verify")
    return None


def _rid_uniqueness_refusal(rid: Any) -> ContractError | None:
    """``_validate_rid_uniqueness`` (``io_struct.py`` 390-397), the last check of
    ``normalize_batch_and_arguments`` (442), in its words: a ``rid`` list naming one rid twice
    (the rids named more than once, in the order first named, as a Python list)."""
    if type(rid) is not list or len(set(rid)) == len(rid):
        return None
    duplicates = [r for r, count in Counter(rid).items() if count > 1]
    return ContractError(f"Duplicate request IDs detected within the request: {duplicates}", step="verify")


def _init_refusal(body: dict[str, Any]) -> ContractError | None:
    """``_init_req_state`` (``tokenizer_manager.py`` 926, 3818-3831), which builds every item's
    sub-request (``obj[i]``, ``io_struct.py`` 972-982) before registering the rids: a per-item
    list of a batch, or of one request parallel samples make a batch of one
    (:func:`_normalized_batch`), kept as sent (722-747), too short for the entries it reads
    (:func:`_entries_read`) is an IndexError there (:data:`NO_SHORT_LIST`; such a request's empty
    ``video_data``, ``lora_path`` or ``bootstrap_host`` list too); one request's ``rid`` list a
    TypeError as its rid is looked up (:data:`NO_RID_LIST`, 3835); then ``text`` with
    ``input_ids`` of another shape (:data:`NO_TEXT_AND_IDS`)."""
    batch = _normalized_batch(body)
    if batch is not None:
        needed = _entries_read(body, batch)
        for key in PER_ITEM_LISTS:
            value = body.get(key)
            if _per_item_list(key, value) and len(value) < needed:
                return _short(key, value, batch)
    return _rid_list_for_one(body) or _text_and_ids_refusal(body)


def _entries_read(body: dict[str, Any], batch: int) -> int:
    """How many entries of a per-item list (:data:`PER_ITEM_LISTS`) of a batch of ``batch``
    ``_init_req_state`` needs: it builds ``obj[i]`` for each of the request's rids
    (``tokenizer_manager.py`` 3820-3831), and with ``n`` parallel samples each list is repeated
    ``n`` times (``io_struct.py`` 636-642, 722-747, 907-947) while only rids it made itself are
    expanded (759-772: a rid list keeps one per item), so: the batch's size, but
    ``ceil(batch / n)`` with parallel samples and a ``rid`` list (a shorter list then serves the
    items by repeating)."""
    n = _parallel_count(body)
    if n > 1 and type(body.get("rid")) is list:
        return -(-batch // n)
    return batch


def _items(body: dict[str, Any]) -> list[tuple[str, dict[str, Any], Any]]:
    """Each item's ``sampling_params`` (where it stands, the object, ``{}`` for none) and its
    top-level ``watermark`` (a batch's list has one per item, io_struct.py 749-757)."""
    batch = _batch_size(body)
    top, params = body.get("watermark"), body.get("sampling_params")
    listed = type(params) is list
    per_item = batch is not None and type(top) is list
    items = []
    count = batch if batch is not None else len(params) if listed else 1  # a longer list's rest unread
    for i in range(count):
        p = (params[i] if i < len(params) else None) if listed else params
        item_top = (top[i] if i < len(top) else None) if per_item else top
        items.append((f"sampling_params[{i}]" if listed else "sampling_params", p or {}, item_top))
    return items


def batch_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal ``normalize_batch_and_arguments`` makes of a ``/generate`` body steps 1 and 2
    took (:func:`_normalize_refusal`; ``tokenizer_manager.py`` 903, the first thing
    ``generate_request`` does), or None. For a caller that runs step 3 itself in SGLang's order,
    between its own refusals (the local engine: ``GenerateReqInput.normalize``)."""
    refused = _normalize_refusal(body)
    return None if refused is None else Refusal.of(refused)


def short_list_refusal(body: dict[str, Any]) -> Refusal | None:
    """The refusal ``_init_req_state`` makes of such a body (:func:`_init_refusal`: a short
    list, :data:`NO_SHORT_LIST`), or None; SGLang makes it after the priority,
    ``max_thinking_tokens`` and ``routed_dp_rank`` (``tokenizer_manager.py`` 904-926) and
    before it registers the rids (3833-3837)."""
    refused = _init_refusal(body)
    return None if refused is None else Refusal.of(refused)


def item_refusal(body: dict[str, Any], index: int) -> Refusal | None:
    """The refusal ``_create_tokenized_object`` makes of item ``index`` of a ``/generate`` body
    steps 1 and 2 took (:func:`item_sampling_refusal`: a watermark set both ways, a ``choice``, a
    malformed watermark, ``SamplingParams.normalize``/``verify``; ``tokenizer_manager.py``
    1548-1567), or None. SGLang runs it per item after that item's other step-3 checks (LoRA,
    ``input_embeds``, the context length, hidden states, the custom logit processor:
    ``generate_request`` 903-942, ``_tokenize_one_request`` 1096-1434), so a caller that makes
    those runs this after them."""
    where, p, top = _items(body)[index]
    refused = item_sampling_refusal(where, p, top)
    return None if refused is None else Refusal.of(refused)
