"""The process a model's chat template renders in: ``python -m powerinfer_tools.serving.template_sandbox``.

A chat template is code that came with the model. Jinja2's immutable sandbox keeps it from Python's
internals and from changing the messages, but not from running for hours (loops nested over
``range(100000)``) or asking for gigabytes (``"x" * 10**9``, ``"x".ljust(10**10)``), and much of that
work happens inside single C calls that nothing in the same process can interrupt. Even compiling one
runs some of it: Jinja2 computes constant expressions (``"x" | center(10**9)``) while compiling. So
templates are compiled and rendered here, apart from the server: the server kills this process when a
render passes its time bound (and starts another for the next render), RLIMIT_DATA bounds its memory (a
MemoryError, reported as such), and the output is counted as the template produces it and cut at its
bound.

The exchange is one JSON line each way (ASCII, so no locale matters). The server sends the setup,
``{"source", "memory_bytes"}``, and gets ``{"ready": true}`` once the template is compiled (``{"error"}``
if it is not valid Jinja); then each ``{"variables", "max_chars"}`` gets ``{"text"}`` or
``{"error", "code"}``. The process ends when the server closes its end of the pipe. It imports only
Jinja2 and the standard library, so that starting one takes a fraction of a second.
"""

from __future__ import annotations

import datetime
import json
import resource
import signal
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox

LIMIT_CODE = "chat_template_limit_exceeded"  # the template passed a bound of time or memory
TOO_LONG_CODE = "context_length_exceeded"  # it wrote more than a prompt may be


class _Refusal(Exception):
    """The template called ``raise_exception``: it does not accept these messages."""


def _raise_exception(message: str):
    raise _Refusal(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def sandboxed_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment Hugging Face transformers renders chat templates in: its options and helpers
    (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson``
    that keeps non-ASCII text)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def render(template: jinja2.Template, variables: dict, max_chars: int) -> dict:
    """The reply to one request: the rendered text, or why there is none."""
    pieces, length = [], 0
    try:
        for piece in template.generate(**variables):
            length += len(piece)
            if length > max_chars:
                return _error(f"the chat, as the model's chat template renders it, is longer than {max_chars:,} "
                              "characters: more than the model's context window can hold", TOO_LONG_CODE)
            pieces.append(piece)
        text = "".join(pieces)
        text.encode("utf-8")
        return {"text": text}
    except _Refusal as exc:
        return _error(f"the model's chat template refused the messages: {exc}")
    except jinja2.exceptions.SecurityError as exc:
        return _error(f"the model's chat template did something its sandbox forbids: {exc}")
    except MemoryError:
        memory = resource.getrlimit(resource.RLIMIT_DATA)[0]
        return _error(f"the model's chat template needed more than {memory >> 20} MiB of memory on these messages",
                      LIMIT_CODE)
    except UnicodeEncodeError:
        return _error("the model's chat template wrote text that is not valid Unicode (an unpaired surrogate)")
    except Exception as exc:  # the template is foreign code: any failure of it is about these messages
        return _error(f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}")


def _error(message: str, code: str | None = None) -> dict:
    return {"error": message, "code": code}


def _limit_memory(limit: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _send(message: dict) -> None:
    sys.stdout.buffer.write(json.dumps(message).encode("ascii") + b"\n")
    sys.stdout.buffer.flush()


def main() -> None:
    # Ctrl-C at a terminal reaches the server's whole process group; the server decides when this one ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup = json.loads(sys.stdin.buffer.readline())
    _limit_memory(setup["memory_bytes"])
    try:
        template = sandboxed_environment().from_string(setup["source"])
    except jinja2.TemplateSyntaxError as exc:
        _send(_error(f"the model's chat template is not valid Jinja: {exc.message} (line {exc.lineno})"))
        return
    _send({"ready": True})
    for line in sys.stdin.buffer:
        request = json.loads(line)
        _send(render(template, request["variables"], request["max_chars"]))


if __name__ == "__main__":
    main()
