"""Chat templating: OpenAI's roles mapped onto the turns chat templates render, then the model's template.

Contract of ``canonical_turns(messages)`` (pairs of OpenAI role and text), a pure function:
- ``developer`` is ``system`` (OpenAI's name for system instructions on newer models).
- ``tool`` (a tool's result) is said by the user's side: a ``user`` turn, as Qwen's
  templates render tool results inside a user turn. No template here knows a tool role,
  and Gemma's would render it as a turn named ``tool``.
- System messages before the first user or assistant message become one leading
  ``system`` message; a later one is an instruction from the user's side and opens the
  next user turn (Gemma's templates fold the system message into the first user turn
  the same way), or is a user turn of its own when none follows.
- Consecutive turns of one role become one turn, their texts joined by a blank line, so
  user and assistant alternate as templates such as Gemma's require.
- A conversation of system messages alone is one ``user`` turn with their text: templates
  render system text only ahead of a user turn (Gemma's dropped it, rendering an empty
  prompt), and the instruction is what the model is asked to follow.

``render_chat(tokenizer, architecture, turns)`` renders those turns with the tokenizer's
own chat template (transformers' ``apply_chat_template``, as vLLM does) followed by the
assistant's generation prompt, or, for a tokenizer without one, with the family's turn
format. A template that rejects the conversation raises ``TemplateRejected``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jinja2 import TemplateError

GEMMA_TURNS = "<start_of_turn>{role}\n{content}<end_of_turn>\n"
CHATML_TURNS = "<|im_start|>{role}\n{content}<|im_end|>\n"
JOIN = "\n\n"
_AS = {"developer": "system", "tool": "user"}


class TemplateRejected(ValueError):
    """The model's chat template refused the conversation; the message is the template's."""


def canonical_turns(messages: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    """The turns a chat template renders for OpenAI ``messages`` (see the module contract)."""
    system: list[str] = []
    turns: list[tuple[str, list[str]]] = []  # each turn's texts, joined once at the end (no quadratic concatenation)
    pending: list[str] = []  # system text after the conversation started, for the next user turn
    for given, text in messages:
        role = _AS.get(given, given)
        if role == "system":
            (pending if turns else system).append(text)
            continue
        texts = [*pending, text] if role == "user" else [text]
        if role == "user":
            pending = []
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(texts)
        else:
            turns.append((role, texts))
    if pending:
        if turns[-1][0] == "user":
            turns[-1][1].extend(pending)
        else:
            turns.append(("user", pending))
    if not turns:
        return [{"role": "user", "content": JOIN.join(system)}]
    head = [{"role": "system", "content": JOIN.join(system)}] if system else []
    return head + [{"role": role, "content": JOIN.join(texts)} for role, texts in turns]


def render_chat(tokenizer: Any, architecture: str, turns: list[dict[str, str]]) -> str:
    """The prompt text of ``turns`` (from ``canonical_turns``) ending in the assistant's generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        try:
            return str(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        except TemplateError as exc:
            raise TemplateRejected(str(exc)) from exc
    if architecture == "gemma3":
        # Gemma's turn format: roles user and model; the system text opens the first user turn.
        text, system = "<bos>", ""
        for turn in turns:
            if turn["role"] == "system":
                system = turn["content"] + JOIN
                continue
            role = "model" if turn["role"] == "assistant" else "user"
            text += GEMMA_TURNS.format(
                role=role, content=(system + turn["content"]) if role == "user" else turn["content"]
            )
            system = ""
        return text + "<start_of_turn>model\n"
    return "".join(CHATML_TURNS.format(**turn) for turn in turns) + "<|im_start|>assistant\n"
