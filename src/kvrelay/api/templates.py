"""Chat templating: the tokenizer's own template when it has one, else the family's standard one."""

from __future__ import annotations

from typing import Any

GEMMA_TURNS = "<start_of_turn>{role}\n{content}<end_of_turn>\n"
CHATML_TURNS = "<|im_start|>{role}\n{content}<|im_end|>\n"


def render_chat(tokenizer: Any, architecture: str, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` followed by the prompt of the assistant's turn."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if architecture == "gemma3":
        # Gemma's turn format: roles user and model; a system message is prepended to the first user turn.
        text, system = "<bos>", ""
        for m in messages:
            if m["role"] in ("system", "developer"):
                system += m["content"] + "\n\n"
                continue
            role = "model" if m["role"] == "assistant" else "user"
            text += GEMMA_TURNS.format(role=role, content=(system + m["content"]) if role == "user" else m["content"])
            system = ""
        text += "<start_of_turn>model\n"
    else:
        text = "".join(CHATML_TURNS.format(role=m["role"], content=m["content"]) for m in messages)
        text += "<|im_start|>assistant\n"
    return list(tokenizer.encode(text, add_special_tokens=False))
