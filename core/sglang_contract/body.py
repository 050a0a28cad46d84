"""The one check of a whole ``/generate`` body: every field through steps 1 and 2, then step 3
(:func:`generate_body_refusal`, :func:`generate_body_error`)."""

from __future__ import annotations

from typing import Any

from core.sglang_contract.fields import GENERATE_FIELDS
from core.sglang_contract.normalize import tokenizer_refusal
from core.sglang_contract.refusal import ContractError, Refusal, Step
from core.sglang_contract.values import refuse


def generate_body_refusal(
    body: Any, skip: frozenset[str] = frozenset(), through: Step = "verify"
) -> Refusal | None:
    """The first refusal SGLang makes in the parsed ``/generate`` JSON ``body`` (one line naming
    the field, and the step that makes it), or None; the fields in ``skip`` are not looked at (a
    caller that checks them itself). A body that is not an object is the dataclass parse's.
    The steps run in turn, each over the whole body: a field the parse refuses is the answer
    wherever it stands, then the first (in the body's order) the gate refuses, then the first
    ``SamplingParams`` refuses. ``through="gate"`` stops after step 2, for a caller that runs
    step 3 itself (:func:`batch_refusal`, :func:`item_refusal`) among its own step-3 refusals."""
    if type(body) is not dict:
        return Refusal("parse", str(refuse("body", body, "a map")))
    first: Refusal | None = None
    for key, x in body.items():
        check = GENERATE_FIELDS.get(key)
        if check is None or key in skip:
            continue
        try:
            check(key, x)
        except ContractError as exc:
            if first is None or _STEPS.index(exc.step) < _STEPS.index(first.step):
                first = Refusal.of(exc)
    if first is not None or through != "verify":
        return first
    refused = tokenizer_refusal(body)
    return None if refused is None else Refusal.of(refused)


_STEPS: tuple[Step, ...] = ("parse", "gate", "verify")


def generate_body_error(body: Any, skip: frozenset[str] = frozenset()) -> str | None:
    """The line of :func:`generate_body_refusal`, or None."""
    refusal = generate_body_refusal(body, skip)
    return None if refusal is None else refusal.message
