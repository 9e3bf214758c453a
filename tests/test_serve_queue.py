"""The server's queue on a slowed model, in this process: one slot (--parallel 1), a bounded queue answering 503
with Retry-After, and clients that leave giving back the model (or their place) at once.

The model is the bundled one on the runtime with every forward pass slowed by ``serving.STEP_SECONDS`` and its
end-of-sequence token never chosen, so a generation lasts as long as the test needs it to.
"""

from __future__ import annotations

import httpx
import pytest

from serving import LONG, SHORT, in_background, metric, running, slowed, streaming, until
from powerinfer_tools.runtime.llm import LLM
from powerinfer_tools.serving.app import ServeSettings, create_app


@pytest.fixture(scope="module")
def url(bundled_gguf):
    llm = slowed(LLM.load(bundled_gguf("q8_0")))
    with running(create_app(llm, ServeSettings("tiny", max_queue=1, parallel=1))) as url:
        yield url


def test_a_full_queue_answers_503_and_a_stream_that_leaves_frees_the_model_at_once(url):
    with streaming(url, LONG):
        waiting = in_background(lambda: httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60))
        until(lambda: metric(url, "queue_length") == 1)
        refused = httpx.post(f"{url}/v1/completions", json=SHORT)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["Retry-After"]) >= 1
        cancelled = metric(url, "generations_cancelled_total")
    # The long stream had ~6 s to go; its client left, so the waiting request runs now.
    waited = until(lambda: "response" in waiting, seconds=30)
    assert waiting["response"].status_code == 200
    assert waited < 2.0, f"the queued request waited {waited:.1f} s after the stream's client left"
    assert metric(url, "generations_cancelled_total") == cancelled + 1


def test_a_queued_client_that_leaves_gives_its_place_back(url):
    with streaming(url, LONG):
        with streaming(url, LONG, started=False):
            until(lambda: metric(url, "queue_length") == 1)
        until(lambda: metric(url, "queue_length") == 0, seconds=2)
        waiting = in_background(lambda: httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60))
        until(lambda: metric(url, "queue_length") == 1)  # admitted: the place was free again
    until(lambda: "response" in waiting, seconds=30)
    assert waiting["response"].status_code == 200


def test_a_client_that_stops_waiting_for_a_whole_answer_cancels_its_generation(url):
    until(lambda: metric(url, "requests_running") == 0, seconds=30)
    cancelled = metric(url, "generations_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=0.5))
    until(lambda: metric(url, "requests_running") == 0, seconds=2)
    assert metric(url, "generations_cancelled_total") == cancelled + 1


def test_generation_is_bounded_by_the_context_window(url):
    body = {**SHORT, "max_tokens": 10_000, "prompt": "x " * 120}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["total_tokens"] == 256  # the bundled model's window


def test_chat_with_a_model_that_has_no_template_is_a_400(bundled_gguf):
    llm = LLM.load(bundled_gguf("q8_0"))
    llm.tokenizer.chat_template = None
    with running(create_app(llm, ServeSettings("tiny"))) as url:
        response = httpx.post(f"{url}/v1/chat/completions",
                              json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert "no chat template" in response.json()["error"]["message"]


def test_under_a_ram_budget_metrics_report_the_neuron_caches(bundled_gguf):
    llm = LLM.load(bundled_gguf("q8_0"), ram=6_000_000)  # under the 8.6 MB file: cold neurons come from disk
    with running(create_app(llm, ServeSettings("tiny"))) as url:
        assert httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60).status_code == 200
        assert 0 <= metric(url, "neuron_cache_hit_rate") <= 1
        assert metric(url, "disk_bytes_total") > 0


def test_a_model_that_fails_is_a_500_or_an_error_event_without_a_traceback(bundled_gguf):
    llm = LLM.load(bundled_gguf("q8_0"))

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel fault")

    llm.engine.forward = llm.engine.forward_batch = broken
    with running(create_app(llm, ServeSettings("tiny"))) as url:
        whole = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60)
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
        streamed = httpx.post(f"{url}/v1/completions", json={**SHORT, "stream": True}, timeout=60)
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and "error" in events[-2] and events[-1] == "data: [DONE]"
        assert "Traceback" not in whole.text + streamed.text and "kernel fault" not in whole.text + streamed.text
        assert httpx.get(f"{url}/health").status_code == 200


def test_concurrent_requests_are_decoded_together_and_a_repeated_beginning_is_reused(bundled_gguf):
    llm = slowed(LLM.load(bundled_gguf("q8_0")))
    prompts = ["import os\n", "def main():\n", "class A:\n"]
    body = {**SHORT, "max_tokens": 24}
    with running(create_app(llm, ServeSettings("tiny", parallel=4))) as url:
        alone = [httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=60).json() for p in prompts]
        steps, tokens = metric(url, "batch_steps_total"), metric(url, "batch_tokens_total")
        assert tokens == steps  # one at a time: batches of one
        together = [in_background(lambda p=p: httpx.post(f"{url}/v1/completions", json={**body, "prompt": p},
                                                         timeout=60).json()) for p in prompts]
        for request in together:
            until(lambda: "response" in request, seconds=60)
        steps, tokens = metric(url, "batch_steps_total") - steps, metric(url, "batch_tokens_total") - tokens
        assert tokens / steps > 1.5, (tokens, steps)  # they ran together most of the time
        assert metric(url, "batch_size_mean") > 1
        # Greedy: the same text alone or in a batch (logits equal up to float32 sums: tests/test_batching.py).
        assert [r["response"]["choices"][0]["text"] for r in together] == [a["choices"][0]["text"] for a in alone]
        # Each prompt was sent before: all but its last token came from the prompt cache.
        assert metric(url, "prompt_cache_hits_total") >= len(prompts)
        assert metric(url, "prompt_tokens_reused_total") >= sum(a["usage"]["prompt_tokens"] - 1 for a in alone)
