"""A model's chat template rendered as Hugging Face transformers renders it, into prompt token ids.

The template is Jinja source that came with the model file (``tokenizer.chat_template`` in GGUF,
``tokenizer_config.json`` in a checkpoint), so it is code from outside the server: it runs in Jinja2's
immutable sandbox (no access to Python internals, no changing the messages), compiled and rendered in a
process of its own (``template_sandbox.py``) so that one that runs away is bounded: past ``render_seconds``
the process is killed (and another started for the next chat), past ``max_chars`` of output or its memory
bound the render is stopped, and each of those is a ChatTemplateError with a code saying which bound.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Optional

from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.interfaces import Tokenizer
from powerinfer_tools.serving import template_sandbox

RENDER_SECONDS = 2.0
MAX_CHARS = 1 << 22
RENDER_MEMORY_BYTES = 512 << 20  # what the renderer may allocate: many times the largest prompt's text
STARTUP_SECONDS = 60.0  # a fresh Python importing Jinja2 and compiling the template, on a busy machine


class ChatTemplateError(PitoolsError):
    """The chat cannot be rendered: the model has no template, the template refused these messages or
    failed on them, or passed a bound on them (``code`` then says which)."""

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.code = code


class RendererClosed(Exception):
    """The chat template was closed (the server is stopping) before it could render."""


class ChatTemplate:
    """A model's template, rendered in its sandbox process, and the tokenizer whose special tokens it spells."""

    def __init__(self, tokenizer: Tokenizer, render_seconds: float = RENDER_SECONDS, max_chars: int = MAX_CHARS):
        self.tokenizer, self.render_seconds, self.max_chars = tokenizer, render_seconds, max_chars
        self._sandbox: Optional[_SandboxProcess] = None
        if tokenizer.chat_template is not None:
            self._sandbox = _SandboxProcess(tokenizer.chat_template)

    @property
    def available(self) -> bool:
        return self._sandbox is not None

    def _special(self, token_id: int | None) -> str:
        return self.tokenizer.token_text(token_id) if token_id is not None else ""

    def render(self, messages: list[dict]) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``), ending with the
        assistant's turn opened (``add_generation_prompt``)."""
        if self._sandbox is None:
            raise ChatTemplateError("the model has no chat template (tokenizer.chat_template); "
                                    "use /v1/completions with a prompt of your own")
        variables = {"messages": messages, "add_generation_prompt": True,
                     "bos_token": self._special(self.tokenizer.bos_token_id),
                     "eos_token": self._special(self.tokenizer.eos_token_id)}
        reply = self._sandbox.render({"variables": variables, "max_chars": self.max_chars}, self.render_seconds)
        if "error" in reply:
            raise ChatTemplateError(reply["error"], reply["code"])
        return reply["text"]

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

    def close(self) -> None:
        """Stop the sandbox process; a render in progress, and any later one, raises RendererClosed."""
        if self._sandbox is not None:
            self._sandbox.close()


class _SandboxProcess:
    """The template's process, one render at a time: started at once (so that a template that does not
    compile is refused when the model loads), killed when a render passes its time or the process dies,
    and started again for the next render."""

    def __init__(self, source: str):
        self._setup = {"source": source, "memory_bytes": RENDER_MEMORY_BYTES}
        self._lock = threading.Lock()
        self._process: Optional[subprocess.Popen] = None
        self._end_process = None  # kills and reaps it: once, whether called or when this object is collected
        self._closed = False
        self._start()

    def render(self, request: dict, seconds: float) -> dict:
        with self._lock:
            process = self._started()
            try:
                _send(process, request)
                return _receive(process, time.monotonic() + seconds)
            except TimeoutError:
                self._stop()
                raise ChatTemplateError(f"the model's chat template took longer than {seconds:g} s on these messages",
                                        template_sandbox.LIMIT_CODE) from None
            except (EOFError, BrokenPipeError):
                self._stop()
                if self._closed:
                    raise RendererClosed() from None
                raise ChatTemplateError(f"the model's chat template ended its process on these messages (exit "
                                        f"status {process.returncode})", template_sandbox.LIMIT_CODE) from None

    def _started(self) -> subprocess.Popen:
        if self._closed:
            raise RendererClosed()
        if self._process is None:
            self._start()
        return self._process

    def _start(self) -> None:
        process = subprocess.Popen([sys.executable, "-m", template_sandbox.__name__],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._process, self._end_process = process, weakref.finalize(self, _end, process)
        try:
            _send(process, self._setup)
            reply = _receive(process, time.monotonic() + STARTUP_SECONDS)
        except (TimeoutError, EOFError, BrokenPipeError):
            self._stop()
            if self._closed:
                raise RendererClosed() from None
            raise PitoolsError(f"the model's chat template could not be compiled: its sandbox process took longer "
                               f"than {STARTUP_SECONDS:g} s or ended (exit status {process.returncode})") from None
        if "error" in reply:
            self._stop()
            raise PitoolsError(reply["error"])

    def _stop(self) -> None:
        self._end_process()
        self._process = None

    def close(self) -> None:
        self._closed = True
        if (process := self._process) is not None:
            process.kill()  # a render in progress ends now: its reply never comes
        with self._lock:
            if self._process is not None:
                self._stop()


def _send(process: subprocess.Popen, message: dict) -> None:
    data = memoryview(json.dumps(message).encode("ascii") + b"\n")
    while data:
        data = data[process.stdin.write(data):]


def _receive(process: subprocess.Popen, deadline: float) -> dict:
    """The process's next line, read by ``deadline`` (else TimeoutError); EOFError if it ended first."""
    fd = process.stdout.fileno()
    line = bytearray()
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError()
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            process.wait()
            raise EOFError()
        line += chunk
    return json.loads(line)


def _end(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()
    process.stdin.close()
    process.stdout.close()
