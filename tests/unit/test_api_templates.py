"""Chat rendering: OpenAI's roles become the turns templates render, checked with the tiny models' template, the
template of the served Gemma 3 270M, and a template that enforces Gemma 3's published rules."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.api.templates import TemplateRejected, canonical_turns, render_chat
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.testing.tiny_models import make_tiny_model

STRICT_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(prefix='', turns=messages) %}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set ns.prefix = messages[0]['content'] + '\\n\\n' %}{% set ns.turns = messages[1:] %}{% endif %}"
    "{% for m in ns.turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (ns.prefix if loop.first else '') + m['content'] }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""The rules of Gemma 3's published instruction template, written for this test: a leading system message opens
the first user turn, then user and model alternate starting with user, and anything else is an error."""

SYSTEM = " ".join(f"rule{i}" for i in range(500))
CONVERSATIONS: list[list[tuple[str, str]]] = [
    [("system", "be brief")],
    [("developer", "be brief"), ("user", "hi")],
    [("system", "a"), ("developer", "b"), ("user", "hi"), ("user", "there")],
    [("user", "weather?"), ("assistant", "calling"), ("tool", "sunny, 21 C"), ("tool", "wind 3 m/s")],
    [("user", "hi"), ("assistant", "hello"), ("system", "now answer in French"), ("user", "bye")],
    [("user", "hi"), ("assistant", "hello"), ("developer", "now answer in French")],
    [("user", "hi"), ("assistant", "hello"), ("assistant", "again")],
]


@pytest.mark.parametrize(
    ("messages", "turns"),
    [
        ([("system", "S")], [("user", "S")]),
        ([("system", "A"), ("developer", "B")], [("user", "A\n\nB")]),
        ([("developer", "D"), ("user", "U")], [("system", "D"), ("user", "U")]),
        ([("user", "U"), ("assistant", "A"), ("tool", "T")], [("user", "U"), ("assistant", "A"), ("user", "T")]),
        ([("user", "U"), ("tool", "T")], [("user", "U\n\nT")]),
        (
            [("user", "U"), ("assistant", "A"), ("system", "S"), ("user", "V")],
            [("user", "U"), ("assistant", "A"), ("user", "S\n\nV")],
        ),
        ([("user", "U"), ("assistant", "A"), ("system", "S")], [("user", "U"), ("assistant", "A"), ("user", "S")]),
        ([("system", "S"), ("assistant", "A")], [("system", "S"), ("assistant", "A")]),
        ([("user", "U"), ("user", "V"), ("assistant", "")], [("user", "U\n\nV"), ("assistant", "")]),
    ],
)
def test_roles_map_onto_alternating_turns(messages: list[tuple[str, str]], turns: list[tuple[str, str]]) -> None:
    assert canonical_turns(messages) == [{"role": r, "content": c} for r, c in turns]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_artifacts(make_tiny_model("llama", tmp_path_factory.mktemp("templates"))).tokenizer


def check_rendering(tokenizer: Any, architecture: str, model_turn: str) -> None:
    """Every message's text is in the prompt, in order; no turn is named system (but a leading one), developer or
    tool; a system-only chat is the user turn; developer renders exactly as system."""
    for messages in CONVERSATIONS:
        text = render_chat(tokenizer, architecture, canonical_turns(messages))
        at = 0
        for _, content in messages:
            at = text.index(content, at)
        assert "<start_of_turn>developer" not in text and "<start_of_turn>tool" not in text, text
        assert text.count("<start_of_turn>system") <= 1 and text.endswith(f"<start_of_turn>{model_turn}\n"), text
    alone = render_chat(tokenizer, architecture, canonical_turns([("system", SYSTEM)]))
    assert f"<start_of_turn>user\n{SYSTEM}" in alone
    assert len(tokenizer.encode(alone, add_special_tokens=False)) > 500
    as_developer = render_chat(tokenizer, architecture, canonical_turns([("developer", "D"), ("user", "U")]))
    assert as_developer == render_chat(tokenizer, architecture, canonical_turns([("system", "D"), ("user", "U")]))


def test_the_tiny_models_template_renders_every_role(tiny_tokenizer: Any) -> None:
    check_rendering(tiny_tokenizer, "llama", "assistant")


@pytest.mark.slow
def test_the_served_gemma_template_renders_every_role(gemma_tokenizer: Any) -> None:
    check_rendering(gemma_tokenizer, "gemma3", "model")


@pytest.mark.slow
def test_gemma_3s_published_rules_accept_every_conversation(gemma_tokenizer: Any) -> None:
    served = gemma_tokenizer.chat_template
    try:
        gemma_tokenizer.chat_template = STRICT_GEMMA_TEMPLATE
        check_rendering(gemma_tokenizer, "gemma3", "model")
        with pytest.raises(TemplateRejected, match="must alternate"):
            render_chat(gemma_tokenizer, "gemma3", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    finally:
        gemma_tokenizer.chat_template = served


def test_without_a_template_the_family_format_renders_the_turns(tiny_tokenizer: Any) -> None:
    turns = canonical_turns([("developer", "D"), ("user", "U"), ("assistant", "A"), ("tool", "T")])
    gemma = render_chat(object(), "gemma3", turns)
    assert gemma == (
        "<bos><start_of_turn>user\nD\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
        "<start_of_turn>user\nT<end_of_turn>\n<start_of_turn>model\n"
    )
    chatml = render_chat(object(), "llama", turns)
    assert chatml.startswith("<|im_start|>system\nD<|im_end|>\n") and "<|im_start|>tool" not in chatml
