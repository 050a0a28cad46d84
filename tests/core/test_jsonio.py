"""core.jsonio: sorted output writes a dataclass as ``dataclasses.asdict`` makes it (the bytes the
digests of requests hash: a stored digest stays the same whoever computes it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from core.jsonio import dumps
from router.chat.renderers import Message, Tool, ToolCall
from router.chat.service import ChatRequest, chat_digest


@dataclasses.dataclass(frozen=True)
class Inner:
    zeta: int
    alpha: tuple[str, ...]
    extra: dict[str, object]


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner
    items: tuple[Inner, ...] = ()
    maybe: float | None = None


VALUE = Outer(
    "o",
    Inner(2, ("b", "a"), {"y": 1, "x": [Inner(0, (), {})]}),
    (Inner(1, ("c",), {"k": None}),),
    float("nan"),
)


def test_sorted_dumps_writes_a_dataclass_as_asdict_makes_it() -> None:
    assert dumps(VALUE, sort_keys=True) == dumps(dataclasses.asdict(VALUE), sort_keys=True)
    text = dumps(VALUE, sort_keys=True).decode()
    assert text.index('"inner"') < text.index('"items"') < text.index('"maybe"') < text.index('"name"')
    assert json.loads(text)["maybe"] is None
    # unsorted, a dataclass keeps its fields' order (orjson's own)
    assert dumps(VALUE).decode().index('"name"') < dumps(VALUE).decode().index('"inner"')


def test_the_json_fallback_writes_the_same_objects() -> None:
    """An integer beyond 64 bits sends the value through :mod:`json`: the same sorted objects."""
    big = Inner(2**70, ("a",), {"b": np.arange(3)})
    assert json.loads(dumps(big, sort_keys=True)) == {
        "alpha": ["a"],
        "extra": {"b": [0, 1, 2]},
        "zeta": 2**70,
    }
    assert dumps(big, sort_keys=True) == dumps(dataclasses.asdict(big), sort_keys=True)


def test_a_chat_requests_digest_is_that_of_its_asdict_form() -> None:
    """The digest an Idempotency-Key keeps (router.chat.service.chat_digest) is the SHA-256 of the
    request's ``dataclasses.asdict`` form without ``supports`` (compact JSON, sorted keys): one
    definition, so a key recorded by any router process matches."""
    req = ChatRequest(
        messages=(
            Message("system", "be brief"),
            Message("user", "list files"),
            Message(
                "assistant", "", reasoning="think", tool_calls=(ToolCall("c1", "bash", '{"cmd": "ls"}'),)
            ),
            Message("tool", "a.py\nb.py", tool_call_id="c1"),
        ),
        tools=(Tool("bash", "run a command", {"type": "object", "properties": {"cmd": {"type": "string"}}}),),
        max_tokens=64,
        temperature=0.7,
        stop=("</s>",),
        supports=True,
    )
    form = dataclasses.asdict(req)
    del form["supports"]
    assert chat_digest(req) == hashlib.sha256(dumps(form, sort_keys=True)).hexdigest()
    assert chat_digest(req) == chat_digest(dataclasses.replace(req, supports=False))
    assert chat_digest(req) != chat_digest(dataclasses.replace(req, max_tokens=65))
