"""The bodies of OpenAI's completions and chat completions protocol: requests as validated models,
responses and stream chunks as the dicts clients expect, errors in OpenAI's JSON shape.

Requests are checked strictly (``"max_tokens": "5"`` is a wrong type, not 5): a client that sends
the wrong thing hears so, rather than getting a guess. Fields a client may send that change nothing
here are accepted and ignored (``user``); fields whose meaning we do not implement are refused when
set to anything but their neutral value (``n: 2``, ``logprobs``, ``tools``), so that no client gets
an answer to a question it did not ask.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from powerinfer_tools.runtime.generation import SamplingConfig

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256


class ProtocolError(Exception):
    """A request we refuse: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


StopField = Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                  Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)],
                  None]


class _GenerationRequest(_Strict):
    """What both endpoints share: the model, sampling, stopping and streaming."""

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # not OpenAI's: llama.cpp's and vLLM's extension; 0 is off
    seed: Optional[Annotated[int, Field(ge=0, lt=2**64)]] = None
    stop: StopField = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> dict[str, bool]:
        """Each field we do not implement -> whether this request sets it to something that matters."""
        return {"n": self.n != 1, "presence_penalty": self.presence_penalty != 0,
                "frequency_penalty": self.frequency_penalty != 0, "logit_bias": bool(self.logit_bias)}


class CompletionRequest(_GenerationRequest):
    # A text, one text in a list, or token ids; several prompts at once are not supported (n is 1).
    prompt: Union[str, Annotated[list[str], Field(min_length=1, max_length=1)], Annotated[list[int], Field(min_length=1)]]
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None

    def unsupported(self) -> dict[str, bool]:
        return {**super().unsupported(), "echo": self.echo, "suffix": bool(self.suffix),
                "logprobs": self.logprobs is not None, "best_of": self.best_of not in (None, 1)}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # a template may read more keys (name, tool_calls)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def for_template(self) -> dict:
        """As chat templates read a message: ``content`` one string (text parts joined)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = None  # default: the rest of the context window
    max_completion_tokens: Optional[Annotated[int, Field(ge=0)]] = None  # OpenAI's newer name for it
    logprobs: Optional[bool] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> dict[str, bool]:
        text_format = self.response_format is None or self.response_format.get("type") == "text"
        return {**super().unsupported(), "logprobs": bool(self.logprobs), "tools": bool(self.tools),
                "response_format": not text_format}


def completion_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class Reply:
    """One request's response: its id and time, and the dicts of its body or its stream's chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = completion_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str, finish_reason: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        key, content = ("delta", {"content": text} if text else {}) if delta else \
            ("message", {"role": "assistant", "content": text})
        return {"index": 0, key: content, "logprobs": None, "finish_reason": finish_reason}

    def body(self, text: str, finish_reason: str, usage: dict) -> dict:
        return {**self._envelope(False), "choices": [self._choice(text, finish_reason, delta=False)], "usage": usage}

    def chunk(self, text: str, finish_reason: str | None = None, with_usage: bool = False) -> dict:
        chunk = {**self._envelope(True), "choices": [self._choice(text, finish_reason, delta=True)]}
        if with_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last, when usage is asked for
        return chunk

    def first_chunk(self, with_usage: bool) -> dict | None:
        """A chat stream opens with the assistant's role; a completion stream has no such chunk."""
        if not self.chat:
            return None
        chunk = self.chunk("", with_usage=with_usage)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return chunk

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
