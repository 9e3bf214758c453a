"""`pitools serve` against hostile clients and hostile chat templates: JSON built to break the parser,
templates that run away, malformed and slow HTTP, oversized headers, shutdown in the middle of a
stream, and a seeded fuzz of request bodies. Every one must get an answer in OpenAI's error shape (or,
for a client that never sent a request line, a closed connection), never a 5xx, and leave the server
serving.

Servers run in this process (uvicorn on a thread, with the HTTP protocol `pitools serve` uses) with
timeouts of a second or two, so that what takes `pitools serve` tens of seconds by default takes this
test seconds; the SIGTERM test runs the real command.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import select
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from serving import LONG, SHORT, in_background, metric, serving_process, slowed, streaming, until
from serving import running as serving_app
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.serving.app import ServeSettings, create_app
from powerinfer_tools.serving.chat_template import ChatTemplate, ChatTemplateError

TESTS = Path(__file__).resolve().parent
HEADER_SECONDS, BODY_SECONDS, TEMPLATE_SECONDS = 1.0, 1.5, 1.0
SLACK = 4.0  # seconds a bound may be passed by on a busy two-core machine (a process start, a thread switch)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
RUNAWAY_TEMPLATES = {
    "nested-loops": NESTED_LOOPS,
    "huge-product": '{{ "x" * 10**9 }}',
    "megabytes-of-output": '{% for i in range(100000) %}{{ "y" * 1000 }}{% endfor %}',  # 100 MB
}


# -- servers -------------------------------------------------------------------------------------

@contextlib.contextmanager
def running(llm: LLM, template: str | None = None, **settings):
    """``llm`` served on a free port (with ``template`` as its chat template); yields the base URL."""
    shared = llm.tokenizer
    if template is not None:  # the app reads the template when made; the model goes on with its own
        llm.tokenizer = copy.copy(shared)
        llm.tokenizer.chat_template = template
    app = create_app(llm, ServeSettings("tiny", **settings))
    llm.tokenizer = shared
    with serving_app(app) as url:
        yield url


@pytest.fixture(scope="module")
def slow_llm(bundled_gguf):
    """The bundled model at 25 ms a token, never choosing EOS (test_serve_queue's)."""
    return slowed(LLM.load(bundled_gguf("q8_0")))


@pytest.fixture(scope="module")
def url(slow_llm):
    """A server with short read timeouts."""
    with running(slow_llm, header_timeout=HEADER_SECONDS, body_timeout=BODY_SECONDS) as url:
        yield url


# -- raw HTTP ------------------------------------------------------------------------------------

def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def request(method: str, path: str, body: bytes = b"", headers: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + headers + b"\r\n" + body


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One response off a raw connection: status, headers (lowercase names), body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a whole response; received {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside a response body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def openai_error(response: tuple[int, dict, bytes], status: int) -> dict:
    """The error of a response that must be ``status`` in OpenAI's JSON error shape."""
    got, headers, body = response
    assert got == status, (got, body[:300])
    assert headers["content-type"] == "application/json", headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def readable(socks, seconds: float = 0) -> list[socket.socket]:
    return select.select(list(socks), [], [], seconds)[0]


def within(seconds: float, work):
    """``work()``'s result, failing if it takes longer than ``seconds`` (it is left running then)."""
    result: dict = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as exc:  # handed to the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


# -- 1. JSON built to break the parser ------------------------------------------------------------

@pytest.mark.parametrize("body,limit", [
    (b'{"model": "tiny", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "nested more than 64 deep"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "longer than 100 characters"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN"),
], ids=["deep", "long-number", "nan"])
def test_json_past_the_readers_bounds_is_a_400_and_the_connection_stays_open(url, body, limit):
    with connect(url) as sock:
        sock.sendall(request("POST", "/v1/completions", body))
        error = openai_error(read_response(sock), 400)
        assert limit in error["message"]
        sock.sendall(request("GET", "/health"))  # the same keep-alive connection
        assert read_response(sock)[0] == 200


# -- 2. chat templates that run away --------------------------------------------------------------

@pytest.mark.parametrize("source", RUNAWAY_TEMPLATES.values(), ids=RUNAWAY_TEMPLATES.keys())
def test_a_runaway_template_is_stopped_at_its_bounds(slow_llm, source):
    tokenizer = copy.copy(slow_llm.tokenizer)
    tokenizer.chat_template = source
    template = ChatTemplate(tokenizer, render_seconds=TEMPLATE_SECONDS, max_chars=1 << 20)
    try:
        start = time.monotonic()
        with pytest.raises(ChatTemplateError) as refused:
            within(TEMPLATE_SECONDS + SLACK, lambda: template.render([{"role": "user", "content": "hi"}]))
        assert refused.value.code in {"chat_template_limit_exceeded", "context_length_exceeded"}
        print(f"{source}: refused in {time.monotonic() - start:.2f} s: {refused.value}")
    finally:
        template.close()


def test_a_template_stopped_once_renders_the_next_chat(slow_llm):
    tokenizer = copy.copy(slow_llm.tokenizer)
    tokenizer.chat_template = ("{% if messages[0].content == 'loop' %}" + NESTED_LOOPS + "{% endif %}"
                               "{{ messages[0].content }}")
    template = ChatTemplate(tokenizer, render_seconds=TEMPLATE_SECONDS)
    try:
        with pytest.raises(ChatTemplateError, match="longer than"):
            within(TEMPLATE_SECONDS + SLACK, lambda: template.render([{"role": "user", "content": "loop"}]))
        assert within(SLACK, lambda: template.render([{"role": "user", "content": "fine"}])) == "fine"
    finally:
        template.close()


def test_rendering_is_counted_against_the_queue_and_over_time_is_a_400(slow_llm):
    with running(slow_llm, NESTED_LOOPS, max_queue=1, parallel=1, template_seconds=TEMPLATE_SECONDS) as url:
        chats = [in_background(lambda: httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60))
                 for _ in range(2)]
        until(lambda: metric(url, "queue_length") == 2)  # both admitted while their templates run
        refused = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        for chat in chats:
            until(lambda: "response" in chat, seconds=2 * TEMPLATE_SECONDS + SLACK)
            answer = chat["response"]
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "chat_template_limit_exceeded"
        assert httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60).status_code == 200


# -- 3. the server's edges ----------------------------------------------------------------------

def test_max_queue_0_runs_one_request_and_refuses_a_second(slow_llm):
    with running(slow_llm, max_queue=0, parallel=1) as url:
        assert httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60).status_code == 200
        with streaming(url, LONG):
            refused = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"


SLOWED_WITH_RUNAWAY_TEMPLATE = f"""import sys
sys.path.insert(0, {str(TESTS)!r})
import powerinfer_tools.commands.options as options
from serving import slowed
load_llm = options.load_llm
def slowed_with_runaway_template(*args, **kwargs):
    llm = slowed(load_llm(*args, **kwargs))
    llm.tokenizer.chat_template = {NESTED_LOOPS!r}
    return llm
options.load_llm = slowed_with_runaway_template
"""


def test_sigterm_ends_streams_with_an_error_event_then_done_and_stops_renders(bundled_gguf, tmp_path):
    with serving_process(bundled_gguf("q8_0"), tmp_path / "sigterm.log", "--model-name", "tiny",
                         "--template-timeout", "60", prelude=SLOWED_WITH_RUNAWAY_TEMPLATE) as (process, url):
        with streaming(url, LONG) as lines:  # ~6 s of tokens to go, more than uvicorn's 5 s of grace
            chat = in_background(lambda: httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60))
            until(lambda: metric(url, "queue_length") == 1)  # the chat admitted, its template running
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
        until(lambda: "response" in chat, seconds=SLACK)
        assert chat["response"].status_code == 503
        assert chat["response"].json()["error"]["code"] == "server_shutting_down"
        assert process.wait(timeout=15) == 128 + signal.SIGTERM
        assert time.monotonic() - signalled < SLACK, "the server took too long to stop"


def test_slow_headers_get_a_408_and_a_silent_connection_is_closed(url):
    loris = [connect(url) for _ in range(20)]
    silent = connect(url)
    for sock in loris:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
    held, deadline = set(loris), time.monotonic() + HEADER_SECONDS + SLACK
    while held and time.monotonic() < deadline:
        for sock in held:
            with contextlib.suppress(OSError):  # answered and closed by the server meanwhile
                sock.sendall(b"X-Slow: 1\r\n")  # a header line every 0.2 s, never the blank line
        time.sleep(0.2)
        held -= set(readable(held))
    assert not held, f"{len(held)} of {len(loris)} slow clients still held after {HEADER_SECONDS + SLACK} s"
    for sock in loris:
        assert "headers" in openai_error(read_response(sock), 408)["message"]
        assert closed_by_server(sock)
        sock.close()
    assert readable([silent], HEADER_SECONDS + SLACK) and closed_by_server(silent)  # no request line: no answer
    silent.close()


def test_a_slow_body_gets_a_408(url):
    with connect(url) as sock:
        sock.sendall(request("POST", "/v1/completions").replace(b"Content-Length: 0", b"Content-Length: 100"))
        deadline = time.monotonic() + BODY_SECONDS + SLACK
        while time.monotonic() < deadline and not readable([sock]):
            with contextlib.suppress(OSError):
                sock.sendall(b" ")  # a byte every 0.2 s: never the whole body
            time.sleep(0.2)
        assert "body" in openai_error(read_response(sock), 408)["message"]
        assert closed_by_server(sock)


@pytest.mark.parametrize("raw", [
    b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"NOT HTTP AT ALL\r\n\r\n",
], ids=["negative-length", "bad-chunk-size", "garbage"])
def test_malformed_requests_get_a_json_400(url, raw):
    with connect(url) as sock:
        sock.sendall(raw)
        openai_error(read_response(sock), 400)


def test_oversized_headers_get_a_json_431(url):
    with connect(url) as sock:
        try:
            sock.sendall(request("GET", "/v1/models", headers=b"Authorization: Bearer " + b"k" * 200_000 + b"\r\n"))
        except OSError as exc:
            pytest.fail(f"the server dropped the connection before reading the request: {exc}")
        openai_error(read_response(sock), 431)


def test_an_api_key_sent_as_utf8_is_accepted_and_its_latin1_reading_is_not(slow_llm):
    key = "clé-ключ"
    with running(slow_llm, api_key=key) as url, connect(url) as sock:
        sock.sendall(request("GET", "/v1/models", headers=b"Authorization: Bearer " + key.encode("utf-8") + b"\r\n"))
        assert read_response(sock)[0] == 200
        mojibake = key.encode("utf-8").decode("latin-1").encode("utf-8")
        sock.sendall(request("GET", "/v1/models", headers=b"Authorization: Bearer " + mojibake + b"\r\n"))
        assert openai_error(read_response(sock), 401)["code"] == "invalid_api_key"


# -- 4. a fuzz of request bodies ------------------------------------------------------------------

FUZZ_CASES = 300
FUZZ_SEED = 30_300_000  # case i draws from random.Random(FUZZ_SEED + i): a failure names it, and replays alone


class Raw(str):
    """JSON text sent as it is: NaN, a 5,000-digit number, a value nested 10,000 deep."""


class Pairs(list):
    """An object as (key, value) pairs, so that a key can come twice."""


def to_json(value) -> str:
    if isinstance(value, Raw):
        return value
    if isinstance(value, dict):
        value = Pairs(value.items())
    if isinstance(value, Pairs):
        return "{" + ", ".join(f"{json.dumps(key)}: {to_json(item)}" for key, item in value) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_json(item) for item in value) + "]"
    return json.dumps(value)


HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 3, 2**31, 2**63, 2**64, -(2**64), 10**40, 0.5, -0.0, 2.5, 1e308, -1e308,
    5e-324, -5e-324, 1e-320, 1e-300, "", "5", "tiny", "é", "\x00", "\ud800", "\udfff\ud800", "x" * 10_000,
    [], [1], [-1], [2**40], [0] * 300, ["a"], ["a"] * 5, [[]], [None], {}, {"a": 1}, {"type": "text"},
    {"type": "text", "text": 5}, [{"type": "text", "text": "hi"}], [{"type": "image", "text": "hi"}],
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"), Raw("9" * 5000),
    Raw("-" + "9" * 101), Raw("0." + "1" * 200), Raw("1E+2"), Raw("0e0"), Raw("-0"),
]
SHARED_FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
                 "presence_penalty", "frequency_penalty", "logit_bias", "user", "max_tokens"]
FIELDS = {
    "/v1/completions": SHARED_FIELDS + ["prompt", "echo", "suffix", "logprobs", "best_of"],
    "/v1/chat/completions": SHARED_FIELDS + ["messages", "max_completion_tokens", "logprobs", "tools",
                                             "response_format", ("messages", 0), ("messages", 0, "role"),
                                             ("messages", 0, "content"), ("messages", 0, "name")],
}
GOOD = {"/v1/completions": {"model": "tiny", "prompt": "def ", "max_tokens": 2},
        "/v1/chat/completions": CHAT}


def hostile_value(rng: random.Random):
    if rng.random() < 0.08:  # nested around the limit, or far past it
        depth = rng.choice([62, 63, 64, 65, 1000, 10_000])
        return Raw("[" * depth + "]" * depth if rng.random() < 0.5 else '{"a": ' * depth + "1" + "}" * depth)
    if rng.random() < 0.05:  # a huge string, under the body's bound
        return "".join(rng.choice("ab é\n{}\"\\") for _ in range(rng.choice([100_000, 400_000])))
    return copy.deepcopy(rng.choice(HOSTILE_VALUES))


def mutated(body: dict, rng: random.Random, fields: list) -> dict | Pairs:
    field = rng.choice(fields)
    path = field if isinstance(field, tuple) else (field,)
    kind = rng.random()
    if kind < 0.12 and len(path) == 1:
        body.pop(field, None)
        return body
    if kind < 0.24 and len(path) == 1:
        return Pairs([*body.items(), (field, hostile_value(rng))])  # a key twice: the last one counts
    with contextlib.suppress(KeyError, IndexError, TypeError):  # an earlier change left no such place
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = hostile_value(rng)
    return body


def hostile_body(rng: random.Random, path: str) -> bytes:
    """A request body, wrong in one to three ways (or, one time in six, not an object at all)."""
    whole = rng.random()
    if whole < 0.04:
        return rng.choice([b"", b"[]", b"5", b'"x"', b"null", b"{", b'{"model": "tiny",}'])
    body = copy.deepcopy(GOOD[path])
    body["stream"] = rng.random() < 0.25
    for _ in range(rng.randint(1, 3)):
        if isinstance(body, Pairs):
            break
        body = mutated(body, rng, FIELDS[path])
    text = to_json(body).encode()
    if whole < 0.10:  # broken UTF-8 (or an encoded surrogate) somewhere in it
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]) + text[at:]
    elif whole < 0.16:
        text = text[:rng.randrange(len(text))]
    return text


def ends_at_once(llm: LLM) -> LLM:
    """The model choosing EOS over every other token by a wide margin: each generation is one step
    (yet with the model's own logits, at any temperature the request asks)."""
    engine, eos = llm.engine, llm.engine.spec.eos_token_id

    def to_eos(compute):
        def at_once(*args, **kwargs):
            logits = np.array(compute(*args, **kwargs))
            logits[..., eos] = logits.max(axis=-1) + 50
            return logits

        return at_once

    engine.forward, engine.forward_batch = to_eos(engine.forward), to_eos(engine.forward_batch)
    return llm


@pytest.fixture(scope="module")
def fuzzed(bundled_gguf):
    app = create_app(ends_at_once(LLM.load(bundled_gguf("q8_0"))), ServeSettings("tiny"))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, app.state.server.scheduler


def check_answer(response: httpx.Response, where: str) -> None:
    assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), where
        assert error["message"] and "Traceback" not in error["message"], where
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", where
        assert not any("error" in json.loads(event) for event in events[:-1]), f"{where}: {events[-3:]}"
    else:
        assert response.json()["choices"], where


@pytest.mark.parametrize("case", range(FUZZ_CASES))
def test_fuzzed_bodies_get_4xx_in_openai_shape_and_the_server_goes_on(fuzzed, case):
    client, scheduler = fuzzed
    rng = random.Random(FUZZ_SEED + case)
    path = rng.choice(list(GOOD))
    body = hostile_body(rng, path)
    where = f"case {case} (seed {FUZZ_SEED + case}): POST {path} {body[:300]!r}"
    check_answer(client.post(path, content=body, headers={"Content-Type": "application/json"}), where)
    until(lambda: scheduler.waiting == 0 and scheduler.running == 0, seconds=10)  # no place left held
    check_answer(client.post(path, json=GOOD[path]), f"a good request after {where}")
