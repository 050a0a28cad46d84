"""A renderer from a checkpoint's own HF chat template (``jinja2``) and ``tokenizer.json``
(``tokenizers``); a family adds how sampled text is parsed (:meth:`Renderer.parse`).

The template runs in the environment transformers gives chat templates (transformers 5.24.0,
``utils/chat_template_utils.py`` 608-669: an ``ImmutableSandboxedEnvironment`` with
``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``; ``tojson`` is ``json.dumps`` with
``ensure_ascii=False`` and unsorted keys; ``raise_exception`` raises a TemplateError).

Segments are cut from whole renders so the template's own text is used everywhere: ``body`` and
``close`` render the messages after a stand-in user and assistant turn whose assistant content is
a sentinel, and take the text after the sentinel (``close``: up to the next message; ``body``: the
rest). Only text between special tokens is ever tokenized apart, so the ids are those of the
whole render wherever the tokenizer splits at added tokens (every HF tokenizer does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.chat.renderers.base import Message, Renderer, RenderError, Tool

_USER = "\u27e6mixfleet-user\u27e7"
_SENTINEL = "\u27e6mixfleet-assistant\u27e7"


def _byte_level_alphabet() -> dict[str, int]:
    """The character a ``ByteLevel`` pre-tokenizer writes for each byte (GPT-2's
    ``bytes_to_unicode``: printable Latin-1 bytes stand for themselves, the others for 256 + n),
    inverted: character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {(chr(b) if b in kept else chr(next(extra))): b for b in range(256)}


_BYTE_OF = _byte_level_alphabet()


def template_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment HF chat templates are written for (module docstring)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def read_chat_template(model_dir: str | Path) -> str:
    """The chat template of a checkpoint: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or the one named ``default`` of a list). ValueError when none."""
    d = Path(model_dir)
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{d}: no readable tokenizer_config.json ({exc})") from None
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):
        tpl = next(
            (t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not isinstance(tpl, str) or not tpl:
        raise ValueError(f"{d}: tokenizer_config.json has no chat_template")
    return tpl


class TemplateRenderer(Renderer):
    """Renders with ``template`` (HF jinja) and ``tokenizer``; ``stop_texts`` are the tokens that
    end an assistant turn (the first is the one the template writes)."""

    def __init__(
        self,
        template: str,
        tokenizer: tokenizers.Tokenizer,
        stop_texts: Sequence[str],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._kwargs = dict(template_kwargs or {})
        self.form = "no-thinking" if self._kwargs.get("enable_thinking") is False else ""
        self._template = template_environment().from_string(template)
        self._tok = tokenizer
        ids = [tokenizer.token_to_id(t) for t in stop_texts]
        missing = [t for t, i in zip(stop_texts, ids, strict=True) if i is None]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} token")
        self.stop_ids = tuple(int(i) for i in ids)
        self._stop_text = {int(i): t for t, i in zip(stop_texts, ids, strict=True)}
        self._close_text = self._after_sentinel([], gp=False)
        self._added = {int(i): t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel)
        self._no_thinking: TemplateRenderer | RenderError | None = None
        if "enable_thinking" not in self._kwargs:
            self._no_thinking = self._variant_without_thinking(template, tokenizer, stop_texts)

    def _variant_without_thinking(
        self, template: str, tokenizer: tokenizers.Tokenizer, stop_texts: Sequence[str]
    ) -> TemplateRenderer | RenderError:
        """:meth:`without_thinking`'s answer, built with the renderer."""
        variant = type(self)(template, tokenizer, stop_texts, {**self._kwargs, "enable_thinking": False})
        probe = [Message("user", _USER)]
        try:
            same = variant.render_text(probe, (), gp=True) == self.render_text(probe, (), gp=True)
        except RenderError as exc:
            return exc
        if same:
            return RenderError(
                "thinking cannot be disabled: the chat template has no no-thinking form (it renders the "
                "same generation prompt with enable_thinking false)"
            )
        return variant

    def without_thinking(self) -> TemplateRenderer:
        """The template rendered with ``enable_thinking=False``, the switch HF chat templates of
        reasoning models take (Qwen3's: its generation prompt then holds an empty
        ``<think>\n\n</think>\n\n``, so the model answers at once; transformers passes extra
        ``apply_chat_template`` keyword arguments to the template the same way). RenderError when
        the template renders the same generation prompt either way: it has no no-thinking form,
        and a "disabled" that the model would not see cannot be honoured."""
        if self._no_thinking is None:  # built with enable_thinking given: its own form
            return self
        if isinstance(self._no_thinking, RenderError):
            raise self._no_thinking
        return self._no_thinking

    @classmethod
    def from_dir(cls, model_dir: str | Path, stop_texts: Sequence[str]) -> TemplateRenderer:
        tok = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        return cls(read_chat_template(model_dir), tok, stop_texts)

    # text -> ids ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """The ids of ``text``. Tokenized by ``encode_batch``, which lets go of the GIL while it
        runs (``encode`` holds it: tokenizers' ``bindings/python/src/tokenizer.rs``), so a long
        text tokenized on a worker thread does not stop the router's event loop."""
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """An added token's text, a byte-level token's bytes (the tokenizer's ``ByteLevel``
        decoder maps each byte to one character), else the UTF-8 of its decoded text."""
        added = self._added.get(token_id)
        piece = self._tok.id_to_token(token_id) if added is None else None
        if piece is not None and self._byte_level and all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
        return (added if added is not None else self.decode([token_id])).encode("utf-8")

    def stop_token(self, text: str) -> int:
        ids = self.encode(text)
        if len(ids) != 1:
            raise RenderError(
                f"stop sequence {text!r} is {len(ids)} tokens: only single-token stop sequences can end a "
                "turn exactly (token-in-token-out)"
            )
        return ids[0]

    # segments ---------------------------------------------------------------------------
    def render_text(
        self, messages: Sequence[Message], tools: Sequence[Tool], gp: bool, *, default_form: bool = False
    ) -> str:
        """The whole template render of ``messages`` (``gp``: with the generation prompt), in this
        renderer's form, or with ``default_form`` in the template's default one (no
        ``enable_thinking`` given)."""
        kwargs = (
            {k: v for k, v in self._kwargs.items() if k != "enable_thinking"}
            if default_form
            else self._kwargs
        )
        try:
            return self._template.render(
                messages=[m.template_dict() for m in messages],
                tools=[t.template_dict() for t in tools] or None,
                add_generation_prompt=gp,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise RenderError(f"the chat template refuses the messages: {exc}") from None

    def head(self, messages: Sequence[Message], tools: Sequence[Tool]) -> list[int]:
        return self.encode(self.render_text(messages, tools, gp=True))

    def body(self, messages: Sequence[Message]) -> list[int]:
        text = self._after_sentinel(messages, gp=True)
        if not text.startswith(self._close_text):
            raise RenderError(
                "the chat template does not close an assistant turn the same way before these messages"
            )
        return self.encode(text[len(self._close_text) :])

    def close(self, output_ids: Sequence[int]) -> list[int]:
        text = self._close_text
        if output_ids and output_ids[-1] in self._stop_text:
            stop = self._stop_text[output_ids[-1]]
            if text.startswith(stop):
                text = text[len(stop) :]
        return self.encode(text)

    def assistant(
        self, before: Sequence[Message], message: Message, after: Sequence[Message], tools: Sequence[Tool]
    ) -> list[int]:
        # cut from the default form: a template writes an assistant message of the history the
        # same way whatever its generation prompt (Qwen3's no-thinking one adds an empty think
        # block only to the prompt), and the message follows the prompt of the form in use
        prompt = self.render_text(before, tools, gp=True, default_form=True)
        full = self.render_text([*before, message, *after], tools, gp=True, default_form=True)
        end = full.find(self._close_text, len(prompt))
        if not full.startswith(prompt) or end < 0:
            raise RenderError("the chat template does not render an edited assistant message in its place")
        return self.encode(full[len(prompt) : end + len(self._close_text)])

    def _after_sentinel(self, messages: Sequence[Message], gp: bool) -> str:
        """The render of ``messages`` after a stand-in assistant turn, from its close on."""
        stand_in = [Message("user", _USER), Message("assistant", _SENTINEL)]
        text = self.render_text([*stand_in, *messages], (), gp=gp)
        at = text.find(_SENTINEL)
        if at < 0 or text.find(_SENTINEL, at + 1) >= 0:
            raise RenderError("the chat template does not render assistant content verbatim")
        return text[at + len(_SENTINEL) :]
