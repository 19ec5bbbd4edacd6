"""The OpenAI-compatible request and reply shapes the simulator serves, as vLLM 0.32 shapes them. Pure.

Requests are checked the way vLLM checks them, and refused with vLLM's error
body (``{"error": {"message", "type", "param", "code"}}``): a body that is not
JSON, an unknown model, ``max_tokens`` below 1, or a prompt and output longer
than the model's context.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

# Words the simulated model "generates": the text is filler, the token counts are what matter.
WORDS = ("the", " batch", " grows", ",", " latency", " follows", ".", " tokens", " flow", " on")
CHARS_PER_TOKEN = 4  # a text prompt's length in tokens, as a rough English average


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            self.status, "InternalServerError"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Completion:
    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


def _text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return _text_tokens(prompt[0])
    raise ApiError(400, "prompt must be a string, or a non-empty list of token ids", "prompt")


def _chat_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    tokens = 0
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content", ""), str):
            raise ApiError(400, "each message must be an object with a string content", "messages")
        tokens += 4 + _text_tokens(message.get("content", ""))  # a few tokens of chat template per message
    return tokens


def parse(body: bytes, *, chat: bool, served_model: str, max_model_len: int) -> Completion:
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(request, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = request.get("model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    prompt_tokens = _chat_tokens(request.get("messages")) if chat else _prompt_tokens(request.get("prompt"))
    key = "max_completion_tokens" if chat and "max_completion_tokens" in request else "max_tokens"
    max_tokens = request.get(key, None)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_tokens if chat else 16
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ApiError(400, f"{key} must be an integer", key)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", key)
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
            key,
        )
    stream = request.get("stream", False) is True
    options = request.get("stream_options") or {}
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    return Completion(chat, model, prompt_tokens, max_tokens, stream, include_usage)


def text_of(tokens: int, start: int = 0) -> str:
    return "".join(WORDS[(start + i) % len(WORDS)] for i in range(tokens))


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(req: Completion, request_id: str, *, streamed: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if streamed else "chat.completion") if req.chat else "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": req.model}


def reply(req: Completion, request_id: str, generated: int, finish_reason: str) -> dict[str, Any]:
    text = text_of(generated)
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice.update(finish_reason=finish_reason, stop_reason=None)
    return {
        **_envelope(req, request_id, streamed=False),
        "choices": [choice],
        "usage": usage(req.prompt_tokens, generated),
    }


def chunk(req: Completion, request_id: str, index: int, finish_reason: str | None) -> dict[str, Any]:
    """One streamed token (``index`` counts from 0), or the closing chunk when ``finish_reason`` is set."""
    text = "" if finish_reason else text_of(1, index)
    if req.chat:
        delta = {} if finish_reason else {"content": text, **({"role": "assistant"} if index == 0 else {})}
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice.update(finish_reason=finish_reason, stop_reason=None)
    return {**_envelope(req, request_id, streamed=True), "choices": [choice]}


def usage_chunk(req: Completion, request_id: str, generated: int) -> dict[str, Any]:
    return {**_envelope(req, request_id, streamed=True), "choices": [], "usage": usage(req.prompt_tokens, generated)}
