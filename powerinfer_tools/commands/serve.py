"""``pitools serve``: the model behind an OpenAI-compatible HTTP API (docs/how-to/serve.md)."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import click

from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.commands.options import load_llm, runtime_options
from powerinfer_tools.commands.spellings import model_argument
from powerinfer_tools.runtime.engine import RuntimeModel
from powerinfer_tools.runtime.batching import DEFAULT_PARALLEL
from powerinfer_tools.runtime.warmup import Policy, load_compiled
from powerinfer_tools.errors import PitoolsError, install_hint
from powerinfer_tools.units import parse_size

API_KEY_VARIABLE = "PITOOLS_API_KEY"


@click.command()
@model_argument(default=BUNDLED_MODEL)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. The default answers this machine only; 0.0.0.0 answers every network "
                   "the machine is on (then give --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="TCP port (0: any free one, printed at start).")
@click.option("--api-key", envvar=API_KEY_VARIABLE, default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every route but /health. Prefer the variable: "
                   "other users of the machine can read a command line.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait (their prompt being rendered and tokenized, or queued for a "
                   "slot) while --parallel generate; more are answered 503 with Retry-After. 0: none waiting.")
@click.option("--parallel", "-np", type=click.IntRange(min=1), default=DEFAULT_PARALLEL, show_default=True,
              help="Generations decoded together: each step computes the next token of every running one, in one "
                   "forward pass (continuous batching: each weight read once for all) or, where that measures slower "
                   "on this model, one compiled pass each; requests join and leave between steps, more wait in "
                   "the queue.")
@click.option("--prompt-cache", default="256MiB", show_default=True, metavar="SIZE",
              help="Memory for finished requests' KV caches, kept so that a prompt beginning with the same tokens "
                   "(a conversation's next turn, a shared system prompt) computes only the rest; 0B keeps none.")
@click.option("--max-body", default="1MiB", show_default=True, help="Largest request body accepted (413 above it).")
@click.option("--template-timeout", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              metavar="SECONDS", help="Longest a chat template may take to render one request's messages "
                                      "(a 400 past it).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              metavar="SECONDS", help="Longest a client may take to send a request's line and headers (a 408 "
                                      "past it; a connection that sent nothing is closed).")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              metavar="SECONDS", help="Longest a client may take to send a request's body once its headers "
                                      "are in (a 408 past it).")
@click.option("--model-name", default=None,
              help="The model's id in the API (the 'model' clients send) [default: MODEL's file or folder name].")
@runtime_options
def serve(model: Path, host: str, port: int, api_key: str | None, max_queue: int, parallel: int, prompt_cache: str,
          max_body: str, template_timeout: float, header_timeout: float, body_timeout: float, model_name: str | None,
          **runtime) -> None:
    """Serve MODEL over OpenAI's HTTP API: /v1/completions, /v1/chat/completions
    (streaming too), /v1/models, /health and /metrics (Prometheus).

    Up to --parallel generations are decoded together, one forward pass per
    token; others wait in a queue of --max-queue. A prompt that begins as
    an earlier request's text did reuses its keys and values (--prompt-cache).
    Chat prompts are rendered with the model's own chat template (from the
    GGUF file or the checkpoint's tokenizer_config.json). The model options
    are those of `pitools run`. Needs the serve extra: pip install -e '.[serve]'
    in the source checkout. Sampling takes OpenAI's defaults (temperature 1),
    where `pitools run` and the Python API are greedy (temperature 0).

    \b
    Examples:
      pitools serve
      pitools serve model.powerinfer.gguf --port 8080 --api-key "$KEY"
      curl http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "tiny-relu-llama", "prompt": "import os", "max_tokens": 16, "temperature": 0}'
    """
    try:
        import uvicorn  # noqa: F401 - the extra's HTTP server, looked for even if serving/ is loaded already

        from powerinfer_tools.serving.app import ServeSettings, create_app
        from powerinfer_tools.serving.uvicorn_server import http_server
    except ImportError as exc:
        raise PitoolsError(f"pitools serve needs the serve extra ({exc.name} is missing): "
                           f"{install_hint('serve')}") from None
    if api_key is not None and not api_key.strip():
        raise PitoolsError("--api-key: empty (unset the variable or give a key)")
    settings = ServeSettings(model_id=model_name or model.name, api_key=api_key, max_queue=max_queue,
                             parallel=parallel, prompt_cache_bytes=parse_size(prompt_cache, "--prompt-cache", minimum=0),
                             max_body_bytes=parse_size(max_body, "--max-body"), template_seconds=template_timeout,
                             header_timeout=header_timeout, body_timeout=body_timeout)
    listener = _listen(host, port)  # before loading: a port in use is found out at once
    llm = load_llm(model, default_kernels=Policy.WAIT, **runtime)
    if isinstance(llm.engine, RuntimeModel):  # ready when listening: the first request finds the kernels loaded
        load_compiled(llm.engine)
    where = listener.getsockname()
    url = f"http://{_url_host(where[0])}:{where[1]}"
    click.echo(f"pitools serve: {settings.model_id} ({llm.description}, context {llm.context_size}) at {url}/v1",
               err=True)
    if api_key is None and not _is_loopback(host):
        click.echo(f"pitools: warning: listening on {host} without --api-key: anyone who reaches this port can "
                   "use the model", err=True)
    http_server(create_app(llm, settings)).run(sockets=[listener])


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, or one error line naming the address."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise PitoolsError(f"{host}:{port}: cannot listen ({exc.strerror or exc})") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
