"""`pitools serve` end to end: the real command in its own process, spoken to by OpenAI's own client.

Greedy answers are compared with `pitools run --temp 0` on the same model, chat prompts with what
transformers' ``apply_chat_template`` renders from the same tokenizer files, and every refusal is
checked to be OpenAI's JSON error shape with the documented status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from cli_checks import invoke
from serving import metric, serving
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.runtime.generation import SamplingConfig
from powerinfer_tools.runtime.llm import LLM

PROMPT = "import os\n"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder_server(tmp_path_factory):
    """The bundled checkpoint, as `pitools serve` with no MODEL serves it (the reference engine)."""
    with serving(BUNDLED_MODEL, tmp_path_factory.mktemp("serve") / "folder.log") as url:
        yield url, BUNDLED_MODEL, "tiny-relu-llama"


@pytest.fixture(scope="module")
def gguf_server(bundled_gguf, tmp_path_factory):
    """The bundled model converted to q8_0, on the runtime."""
    path = bundled_gguf("q8_0")
    with serving(path, tmp_path_factory.mktemp("serve") / "gguf.log", "--model-name", "tiny") as url:
        yield url, path, "tiny"


@pytest.fixture(params=["folder_server", "gguf_server"])
def server(request):
    return request.getfixturevalue(request.param)


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def run_greedy(model: Path, prompt: str, n: int) -> str:
    """What `pitools run --temp 0` prints after the prompt it echoes."""
    result = invoke("run", model, "-p", prompt, "-n", n, "--temp", "0")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(prompt) and result.stdout.endswith("\n")
    return result.stdout[len(prompt):-1]


def test_greedy_completion_is_the_text_of_pitools_run(server):
    url, model, name = server
    answer = client(url).completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0)
    assert answer.choices[0].text == run_greedy(model, PROMPT, 24)
    assert answer.choices[0].finish_reason in ("length", "stop")
    tokens = LLM.load(BUNDLED_MODEL).tokenizer.encode(PROMPT)
    assert answer.usage.prompt_tokens == len(tokens)
    if answer.choices[0].finish_reason == "length":
        assert answer.usage.completion_tokens == 24
    else:  # EOS, counted as a token as OpenAI counts it
        assert answer.usage.completion_tokens <= 24
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_stream_is_the_same_text_in_pieces_then_usage(gguf_server):
    url, _, name = gguf_server
    whole = client(url).completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client(url).completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 5  # streamed as produced, not in one piece
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_renders_the_model_template_as_transformers_does(server):
    from transformers import AutoTokenizer

    url, model, name = server
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "open a file"}]
    reference = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    # transformers renders the text and tokenizes it without special tokens; the server, like llama.cpp's,
    # starts the prompt with BOS as the model's prompts start (add_bos_token), once.
    ids = [reference.bos_token_id] + reference.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False)
    expected = "".join(LLM.load(model).generate(ids, 20, SamplingConfig(temperature=0)))
    chat = client(url).chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected
    assert chat.usage.prompt_tokens == len(ids)
    deltas = list(client(url).chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0,
                                                      stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == expected


def test_a_stop_string_across_a_token_boundary_ends_the_text_before_it(gguf_server):
    url, _, name = gguf_server
    stream = client(url).completions.create(model=name, prompt=PROMPT, max_tokens=32, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    full = "".join(pieces)
    # The end of one token's text and the start of the next: no single token holds this stop string.
    at = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
              and (pieces[i][-2:] + pieces[i + 1][:2]) not in "".join(pieces[: i + 1]))
    stop = pieces[at][-2:] + pieces[at + 1][:2]
    expected = full[: full.index(stop)]
    answer = client(url).completions.create(model=name, prompt=PROMPT, max_tokens=32, temperature=0,
                                            stop=["never appears \u2603", stop])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (expected, "stop")
    streamed = client(url).completions.create(model=name, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop,
                                              stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_seeded_sampling_repeats_and_models_are_listed(gguf_server):
    url, _, name = gguf_server
    c = client(url)
    runs = [c.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9,
                                 extra_body={"top_k": 20}, seed=7).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]
    assert [m.id for m in c.models.list()] == [name]
    assert c.models.retrieve(name).id == name
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


LONG = "x " * 2000

REFUSALS = [  # (body or raw bytes, status, code): what a client gets wrong, and what it is told
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x"}, 422, "invalid_value"),  # no model
    ({"model": "MODEL", "prompt": "x", "max_tokens": "5"}, 422, "invalid_value"),
    ({"model": "MODEL", "prompt": "x", "max_tokens": -1}, 422, "invalid_value"),
    ({"model": "MODEL", "prompt": "x", "temperature": 3}, 422, "invalid_value"),
    ({"model": "MODEL", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 422, "invalid_value"),
    ({"model": "MODEL", "prompt": ["a", "b"]}, 422, "invalid_value"),
    ({"model": "other-model", "prompt": "x"}, 404, "model_not_found"),
    ({"model": "MODEL", "prompt": "x", "n": 2}, 400, "unsupported_parameter"),
    ({"model": "MODEL", "prompt": "x", "logprobs": 1}, 400, "unsupported_parameter"),
    ({"model": "MODEL", "prompt": LONG}, 400, "context_length_exceeded"),
    ({"model": "MODEL", "prompt": [1, 2, 999999]}, 400, None),
    ({"model": "MODEL", "prompt": "\ud800"}, 400, None),
    ({"model": "MODEL", "prompt": "x" * (2 << 20)}, 413, "request_too_large"),
]


@pytest.mark.parametrize("body,status,code", REFUSALS, ids=[f"{s}-{i}" for i, (_, s, _) in enumerate(REFUSALS)])
def test_bad_requests_get_openai_style_errors_not_tracebacks(gguf_server, body, status, code):
    url, _, name = gguf_server
    raw = body if isinstance(body, bytes) else json.dumps(body).replace('"MODEL"', json.dumps(name)).encode()
    response = httpx.post(f"{url}/v1/completions", content=raw, headers={"Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in response.text
    assert error["code"] == code
    assert httpx.get(f"{url}/health").status_code == 200  # and the server is still up


def test_a_body_sent_without_a_length_is_bounded_too(gguf_server):
    url, _, name = gguf_server
    chunks = (b" " * 65536 for _ in range(40))  # 2.5 MiB, chunked: no Content-Length to refuse up front
    response = httpx.post(f"{url}/v1/completions", content=chunks, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_unknown_routes_methods_and_chat_errors(gguf_server):
    url, _, name = gguf_server
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("GET", "/v1/models/other", 404)]:
        response = httpx.request(method, f"{url}{path}")
        assert response.status_code == status and "error" in response.json()
    with pytest.raises(openai.BadRequestError, match="roles system, user and assistant"):
        client(url).chat.completions.create(model=name, messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(openai.UnprocessableEntityError):
        client(url).chat.completions.create(model=name, messages=[])
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


def test_the_api_key_guards_every_route_but_health(bundled_gguf, tmp_path):
    with serving(bundled_gguf("q8_0"), tmp_path / "key.log", "--model-name", "tiny",
                 env={"PITOOLS_API_KEY": "s3cret"}) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/v1/nothing").status_code == 401  # routes are not revealed either
        assert httpx.get(f"{url}/health").status_code == 200
        answer = client(url, "s3cret").completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        assert metric(url, "completion_tokens_total", {"Authorization": "Bearer s3cret"}) == 4


def test_the_sparse_runtime_serves_predicted_neurons(synthesized_tiny, tmp_path):
    """A PowerInfer file with predictors: the same greedy text as `pitools run`, and /metrics shows the
    FFN density the predictors chose (synth planted 10% firing)."""
    model = synthesized_tiny.powerinfer
    with serving(model, tmp_path / "sparse.log") as url:
        answer = client(url).completions.create(model=model.name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert answer.choices[0].text == run_greedy(model, PROMPT, 12)
        assert 0 < metric(url, "ffn_density") < 0.5


def test_32_concurrent_clients_lose_no_request(gguf_server, tmp_path):
    """The load test of docs/lab/serving.md, small: every request answered, none failed."""
    url, _, name = gguf_server
    out = tmp_path / "load.json"
    result = subprocess.run([sys.executable, str(REPO / "examples" / "serve_load_test.py"), "--url", url,
                             "--model", name, "--clients", "32", "--requests", "64", "--max-tokens", "8",
                             "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert (report["requests"], report["succeeded"], report["failed"]) == (64, 64, 0)
    assert report["latency_seconds"]["p99"] >= report["latency_seconds"]["p50"] > 0
