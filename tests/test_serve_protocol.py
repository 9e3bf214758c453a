"""The server's parts that need no server: stop strings over token pieces, chat templates in their
sandbox, and `pitools serve`'s refusals before it listens."""

from __future__ import annotations

import socket
import sys

import pytest

from cli_checks import fails
from powerinfer_tools.bundled import BUNDLED_MODEL
from powerinfer_tools.errors import PitoolsError
from powerinfer_tools.models import load_model_and_tokenizer
from powerinfer_tools.serving.chat_template import ChatTemplate, ChatTemplateError
from powerinfer_tools.serving.stop_strings import StopStrings


def cut(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    """What StopStrings releases after each piece (then the flush), and whether it stopped."""
    matcher = StopStrings(stops)
    out = [matcher.feed(p) for p in pieces]
    return out + [matcher.flush()], matcher.stopped


@pytest.mark.parametrize("pieces,stops,released,stopped", [
    (["ab", "cd"], [], ["ab", "cd", ""], False),
    (["hello wor", "ld!"], ["world"], ["hello ", "", ""], True),  # across the boundary: nothing of it leaks
    (["a\n", "\nb"], ["\n\n"], ["a", "", ""], True),
    (["x</", "s", ">y"], ["</s>"], ["x", "", "", ""], True),  # held over three pieces
    (["ab", "c"], ["abd"], ["", "abc", ""], False),  # held, then released when it cannot be the stop
    (["ab"], ["abd"], ["", "ab"], False),  # held at the end of generation: it is text after all
    (["one", "stop", "two"], ["op", "stop"], ["one", "", "", ""], True),  # the earliest match wins
    (["aaa"], ["aab", "b"], ["a", "aa"], False),
])
def test_stop_strings_hold_back_only_what_could_start_one(pieces, stops, released, stopped):
    assert cut(pieces, stops) == (released, stopped)


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_and_tokenizer(BUNDLED_MODEL)[1]


def with_template(tokenizer, source: str) -> ChatTemplate:
    tokenizer.chat_template = source
    return ChatTemplate(tokenizer)


def test_a_template_that_writes_bos_does_not_double_it(tokenizer):
    bos = tokenizer.bos_token_id
    writes_bos = with_template(tokenizer, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    leaves_it = with_template(tokenizer, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "import os"}]
    assert writes_bos.prompt_ids(messages) == leaves_it.prompt_ids(messages) == tokenizer.encode("import os")
    assert writes_bos.prompt_ids(messages)[:2].count(bos) == 1


@pytest.mark.parametrize("source,match", [
    ("{{ messages.__class__.__mro__ }}", "sandbox forbids"),
    ("{{ ''.__class__.__subclasses__() }}", "sandbox forbids"),
    ("{% set _ = messages.append({}) %}", "sandbox forbids"),  # immutable: the messages cannot change
    ("{{ raise_exception('no system messages') }}", "refused the messages: no system messages"),
    ("{{ messages[5]['content'] }}", "failed on these messages"),
])
def test_templates_run_sandboxed_and_their_failures_are_about_the_messages(tokenizer, source, match):
    with pytest.raises(ChatTemplateError, match=match):
        with_template(tokenizer, source).render([{"role": "user", "content": "hi"}])


def test_template_helpers_are_those_transformers_gives(tokenizer):
    template = with_template(tokenizer, "{{ messages | tojson }}{% for m in messages %}{% if loop.first %}"
                                        "{% continue %}{% endif %}{{ m.content }}{% endfor %}")
    assert template.render([{"role": "user", "content": "é"}, {"role": "user", "content": "b"}]) == \
        '[{"role": "user", "content": "é"}, {"role": "user", "content": "b"}]b'


def test_a_template_that_is_not_jinja_is_refused_when_loaded(tokenizer):
    with pytest.raises(PitoolsError, match="not valid Jinja"):
        with_template(tokenizer, "{% for m in messages %}")


def test_serve_refuses_a_port_in_use_before_loading_anything():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        fails("serve", BUNDLED_MODEL, "--port", port, match=f"127.0.0.1:{port}: cannot listen")


def test_serve_refuses_bad_settings():
    fails("serve", "--max-body", "lots", match="--max-body")
    fails("serve", "--api-key", " ", match="--api-key: empty")


def test_serve_without_its_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    fails("serve", match="pip install -e '.[serve]'")
