"""Render conversations through the target's chat template into token ids and a loss mask.

The loss mask marks the tokens the target wrote: each assistant message's content plus the end-of-turn
token that closes it (so a drafter learns when the target stops).
"""

from __future__ import annotations

from typing import Any


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt (what the server feeds the target)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _assistant_spans(tokenizer: Any, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Character spans of each assistant message's content inside the rendered ``text``."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        content = msg["content"]
        if text.startswith(prefix) and text[len(prefix) : len(prefix) + len(content)] == content:
            start = len(prefix)
        else:  # a template that is not prefix-stable: find the content after the previous span
            start = text.find(content, cursor)
            if start < 0:
                raise ValueError(f"assistant message {i} not found in the rendered conversation")
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def conversation_ids_and_mask(
    tokenizer: Any, messages: list[dict[str, str]], max_len: int
) -> tuple[list[int], list[int]]:
    """Render a whole conversation; return ``(input_ids, loss_mask)`` cut to ``max_len`` tokens.

    ``loss_mask[i] == 1`` when token i was written by the assistant (content or its end-of-turn token).
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    offsets: list[tuple[int, int]] = enc["offset_mapping"]
    spans = _assistant_spans(tokenizer, messages, text)
    eos = tokenizer.eos_token_id
    mask = [0] * len(ids)
    for start, end in spans:
        after: int | None = None
        for t, (a, b) in enumerate(offsets):
            if b > start and a < end and b > a:
                mask[t] = 1
            elif a >= end and after is None:
                after = t
        if after is not None and ids[after] == eos:
            mask[after] = 1
    return ids[:max_len], mask[:max_len]
