"""A model's chat template rendered as Hugging Face transformers renders it, into prompt token ids.

The template is Jinja source that came with the model file (``tokenizer.chat_template`` in GGUF,
``tokenizer_config.json`` in a checkpoint), so it is code from outside the server: it runs in Jinja2's
immutable sandbox (no access to Python internals, no changing the messages), with the options and
helpers transformers gives it (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text).
"""

from __future__ import annotations

import datetime
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import Tokenizer


class ChatTemplateError(PitoolsError):
    """The chat cannot be rendered: the model has no template, or the template refused these messages."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"the model's chat template refused the messages: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class ChatTemplate:
    """A compiled template and the tokenizer whose special tokens it spells."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._template = None
        if tokenizer.chat_template is None:
            return
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(tokenizer.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise PitoolsError(f"the model's chat template is not valid Jinja: {exc.message} (line {exc.lineno})") from None

    @property
    def available(self) -> bool:
        return self._template is not None

    def _special(self, token_id: int | None) -> str:
        return self.tokenizer.token_text(token_id) if token_id is not None else ""

    def render(self, messages: list[dict]) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``), ending with the
        assistant's turn opened (``add_generation_prompt``)."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat template (tokenizer.chat_template); "
                                    "use /v1/completions with a prompt of your own")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self._special(self.tokenizer.bos_token_id),
                                         eos_token=self._special(self.tokenizer.eos_token_id))
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the model's chat template did something its sandbox forbids: {exc}") from None
        except Exception as exc:  # the template is foreign code: any failure of it is about these messages
            raise ChatTemplateError(f"the model's chat template failed on these messages: "
                                    f"{type(exc).__name__}: {exc}") from None

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered chat, its control tokens spelled in the text read as those tokens.

        The tokenizer adds BOS as the model's prompts start; a template that writes ``bos_token`` itself
        would double it, so a BOS spelled at the very start is left to the tokenizer (as llama.cpp's
        server does).
        """
        text = self.render(messages)
        bos = self._special(self.tokenizer.bos_token_id)
        adds_bos = bool(self.tokenizer.encode("", special=True))
        if bos and text.startswith(bos) and adds_bos:
            text = text[len(bos):]
        return self.tokenizer.encode(text, special=True)
