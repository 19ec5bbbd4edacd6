"""The admission door in vLLM's API server: vLLM's own queued caps where the release has them, the plugin's else.

Both hold ``max_num_queued_tokens`` and ``max_num_queued_reqs`` and count what vLLM 0.32 counts
(``batchlens.queued_caps``): the prompt tokens of the requests still in prefill, counted whole, and the
unfinished requests, from the API server's output processor.

- :class:`VllmDoor` (0.29 and later): the caps are the API server's ``scheduler_config``, which vLLM's
  ``check_admission()`` reads on every request. vLLM refuses and counts the refusal itself.
- :class:`PluginDoor` (0.10 to 0.28): the plugin holds the caps, and the arrival middleware refuses a
  generation request before vLLM reads its body, so before any tokenization or rendering work for it (see
  vLLM issue #58192). It counts each refusal in
  ``vllm:admission_rejections_total{model_name,reason}``, the series vLLM 0.29 brought, so that the rules,
  the page and the dashboards read one series on every release. Reading no body, it counts a request as one
  sequence whatever its ``n``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, Counter

from batchlens.predicted_ttft import Seen
from batchlens.queued_caps import MESSAGES, PREDICTED_TTFT

_rejections: Counter | None = None


def rejections() -> Counter:
    """The plugin door's refusals, in the default registry that vLLM's /metrics serves: once per process."""
    global _rejections
    if _rejections is None:
        _rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason (the batchlens plugin's door).",
            ("model_name", "reason"),
        )
    return _rejections


def predicted_rejections(engine_client: Any) -> Any:
    """The per-request door's refusals, in ``vllm:admission_rejections_total{reason="predicted_ttft"}``: vLLM's own
    counter where vLLM registered it in this process (0.29 and later), the plugin door's else, so that one series
    counts every refusal of the door on every release."""
    counter = getattr(REGISTRY, "_names_to_collectors", {}).get("vllm:admission_rejections") or rejections()
    return counter.labels(served_model_name(engine_client), PREDICTED_TTFT)


def request_states(engine_client: Any) -> dict[str, Seen]:
    """What the API server's output processor has of each unfinished request: what the per-request door learns
    from and judges by. Read between two awaits: its writer is on this loop."""
    return {rid: seen(s) for rid, s in list(engine_client.output_processor.request_states.items())}


def seen(state: Any) -> Seen:
    """One request's state as the door reads it. Its output tokens so far are in its stats, which vLLM keeps only
    while it logs stats (the default; not with --disable-log-stats): without them, nor is when it ends known."""
    generated = getattr(getattr(state, "stats", None), "num_generation_tokens", None)
    max_tokens = getattr(state, "max_tokens_param", None) if isinstance(generated, int) else None
    return Seen(state.prompt_len or 0, bool(state.is_prefilling), generated or 0,
                max_tokens if isinstance(max_tokens, int) else None)  # fmt: skip


def served_model_name(engine_client: Any) -> str:
    """The name vLLM's own metrics label the model with (its first served name)."""
    name = getattr(getattr(engine_client, "model_config", None), "served_model_name", None)
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    return str(name) if name else "unknown"


class VllmDoor:
    """vLLM's own caps: setting them on ``scheduler_config`` is enough, and vLLM answers the 503."""

    refuses = False  # vLLM does, in its serving code

    def __init__(self, engine_client: Any):
        self._client = engine_client

    @property
    def caps(self) -> Any:
        return self._client.scheduler_config

    def counts(self) -> tuple[int, int]:
        """This process's (prompt tokens in prefill, unfinished requests), as vLLM's check counts them."""
        processor = self._client.output_processor  # not the client's getters: count_server_wide replaces them
        return processor.get_num_queued_tokens(), processor.get_num_unfinished_requests()

    def count_server_wide(self, totals: Callable[[], tuple[int, int]]) -> None:
        """Make vLLM's own check count the whole server: ``check_admission`` compares the token cap with
        ``self.get_num_queued_tokens()`` (this process's alone, in vLLM) and, where vLLM shares no request count
        (no ``--max-num-queued-reqs`` at launch), the request cap with ``self.get_num_unfinished_requests()``.
        Set on this client instance only: nothing else in vLLM's API server calls either."""
        self._client.get_num_queued_tokens = lambda: totals()[0]
        self._client.get_num_unfinished_requests = lambda: totals()[1]


class _Caps:
    max_num_queued_tokens: int | None = None
    max_num_queued_reqs: int | None = None


class PluginDoor:
    """The same caps on a release without them: held here, applied by the arrival middleware."""

    refuses = True

    def __init__(self, engine_client: Any):
        self.caps = _Caps()
        self._client = engine_client
        model = served_model_name(engine_client)
        self.rejections = {reason: rejections().labels(model, reason) for reason in MESSAGES}

    def count_server_wide(self, totals: Callable[[], tuple[int, int]]) -> None:
        return None  # the middleware judges with the server's totals itself

    def counts(self) -> tuple[int, int]:
        states = self._client.output_processor.request_states  # read between two awaits: its writer is on this loop
        return sum(s.prompt_len for s in states.values() if s.is_prefilling), len(states)
