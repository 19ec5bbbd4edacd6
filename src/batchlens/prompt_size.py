"""A request's prompt in tokens, estimated from its OpenAI body before vLLM reads it. Pure.

The per-request door (predicted_ttft.py) judges a request before vLLM tokenizes it: tokenizing it twice
would double that work on vLLM's serving path. Token ids (``prompt`` as a list of integers) count exactly; text
counts at CHARS_PER_TOKEN ASCII characters a token, the rule of thumb for English and code on the BPE tokenizers
of the models served, and a token for every other character: a Chinese character is about one token on them
(where a Chinese prompt counted at 4 characters a token came to a third of its tokens); and each chat message
adds its template's few tokens. docs/admission.md measures the estimate against real tokenizers and what it
costs the prediction on a real vLLM.
"""

from __future__ import annotations

import json
from typing import Any

CHARS_PER_TOKEN = 4
#: The tokens a chat template adds around each message (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 4


def _text_tokens(text: str) -> int:
    ascii_chars = len(text.encode("ascii", "ignore"))
    return -(-ascii_chars // CHARS_PER_TOKEN) + len(text) - ascii_chars


def _prompt(prompt: Any) -> int | None:
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt:  # a batch of prompts: one request to the door, all its prefill
        counts = [_prompt(p) for p in prompt]
        return None if None in counts or any(isinstance(p, list) and not p for p in prompt) else sum(counts)
    return None


def _content(content: Any) -> int | None:
    if isinstance(content, str):
        return _text_tokens(content)
    if content is None:
        return 0
    if isinstance(content, list):
        return sum(_text_tokens(part["text"]) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))  # fmt: skip
    return None


def prompt_tokens(body: bytes) -> int | None:
    """The prompt tokens of a completion or chat completion body; None: not a body this can read (the door then
    does not judge it: vLLM answers what is wrong with it)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    if "messages" in request:
        messages = request["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        counts = [_content(m.get("content")) for m in messages]
        return None if None in counts else sum(counts) + MESSAGE_OVERHEAD_TOKENS * len(messages)
    return _prompt(request.get("prompt"))
