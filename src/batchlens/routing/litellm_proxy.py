"""The batchlens routing plugin for the LiteLLM proxy (LiteLLM 1.106.12; ``make litellm-env``).

Enable it in the proxy's config (``batchlens build`` writes that config: see
docs/routing.md)::

    litellm_settings:
      callbacks: ["prometheus", "batchlens.routing.litellm_proxy.routing"]
    router_settings:
      enable_tag_filtering: true

It is a proxy pre-call hook, LiteLLM's interface for changing a request
before it is routed. For each request it picks a role (batchlens.routing),
then adds the tags of that role's usable engines to the request, and LiteLLM's
own tag filtering sends it to one of them. Each engine's deployment carries
the tag ``batchlens-engine:<name>``. LiteLLM's newer routing plugins
(``router_settings.plugins``) cannot do this: they narrow candidates by
``litellm_params.model``, which is the same string for every engine serving
one model, and the metadata they see is a copy.

vLLM's request ``priority`` goes in ``extra_body``: LiteLLM takes a top-level
``priority`` for its own scheduler queue and does not forward it. The role's
door priority (``routing.door_priority``) goes in ``extra_headers`` as
``x-batchlens-priority``, which the engine's admission door reads.

An engine door's 503 (``batchlens.queued_caps.cap_refusal``) is retried once,
on another engine of the same role with room, within the request's TTFT budget
(``batchlens.routing.door_retry``). Every routing pass of LiteLLM's goes through
``async_filter_deployments``: after the refusal, its generic retry sends nothing
(the plugin raises the 503 the client will get, with the engine's Retry-After),
and its fallback hop is narrowed to the retry's engines, or sends nothing either.

The configuration comes from ``BATCHLENS_CONFIG`` (engines with their roles,
the ``routing`` section, and ``slo.ttft_seconds``). Any failure inside the
hooks is logged and counted (``batchlens_routing_errors_total``) and the request
goes on as LiteLLM would route it: the plugin never fails a request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException

from batchlens.config import ROLES, load_config
from batchlens.masking import mask_url
from batchlens.routing import door_retry
from batchlens.routing.door_retry import DoorRetry, door_of
from batchlens.routing.proxy_config import deployment_engines, fallback_group
from batchlens.routing.proxy_request import (
    caller_of,
    client_priority,
    drop_claims,
    headers_of,
    prompt_tokens,
    request_tags,
    with_door_priority,
)
from batchlens.routing.router import ENGINE_TAG, Router, wanted_of
from batchlens.routing.trust import screen

log = logging.getLogger("batchlens.routing")
if not logging.getLogger().handlers and not log.handlers:
    # LiteLLM configures only its own loggers: without this, the plugin's INFO lines (its roles at start, the
    # exporter readable again) would never reach the proxy's log.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
#: LiteLLM's call types for generation; other calls pass untouched.
GENERATION_CALLS = frozenset({"completion", "acompletion", "text_completion", "atext_completion"})
#: Calls the plugin does not route that reach vLLM's door all the same (arrivals.GENERATION_PATHS).
DOOR_CALLS = frozenset({"responses", "aresponses"})
#: At most one log line per role and door-retry outcome in this many seconds; the counter has every one.
DOOR_LOG_SECONDS = 60.0


def count_cl100k(model: str = "", **prompt) -> int:
    """A prompt's tokens in tiktoken's cl100k_base (LiteLLM bundles it: no download), whatever the served name.

    LiteLLM's ``token_counter`` picks a tokenizer by the model's name: one containing "llama-3" or "llama-2" makes
    it fetch one from Hugging Face, and offline fall back to tiktoken with a warning, so the long-prompt bound
    would rest on a name. With no name it is always cl100k_base. docs/routing.md states the error against the
    engines' own tokenizers."""
    from litellm import token_counter

    return token_counter(model="", **prompt)


class BatchlensRouting(CustomLogger):
    def __init__(self, router: Router | None = None, count_text=None):
        super().__init__()
        self.router = router or Router(load_config(os.environ.get("BATCHLENS_CONFIG") or None))
        self._count_text = count_text or count_cl100k
        self._warned: set[str] = set()
        self._deployments = deployment_engines(self.router.rules.model, self.router.engines)
        self._fallback_group = fallback_group(self.router.rules.model)
        self._door_lines: dict[tuple[str, str], tuple[float, int]] = {}  # (role, outcome): (last line, since)
        roles = "; ".join(f"{role}: {', '.join(names) or 'none'}" for role, names in self.router.roles.items())
        if not self.router.engines:
            log.warning("batchlens routing: no engines in BATCHLENS_CONFIG: requests go on unrouted")
        log.info("batchlens routing: %s; signals from %s", roles, mask_url(self.router.rules.exporter_url))
        for role, names in self.router.roles.items():
            if not names and self.router.engines:
                fallbacks = ", ".join(self.router.rules.fallbacks.get(role, ())) or "any engine"
                log.info("batchlens routing: no engine has the %s role: requests that want it go to %s, counted "
                         "fallback=\"no_engine\" and kept out of the fallback ratio", role, fallbacks)  # fmt: skip

    async def async_pre_call_hook(self, user_api_key_dict, cache, data: dict, call_type: str):
        if call_type not in GENERATION_CALLS:
            # Unrouted. One that reaches vLLM's door (/v1/responses) goes as standard, never with a client's claim;
            # any other body is left as it is (a pass-through's is sent upstream as it stands).
            return with_door_priority(data, 0) if call_type in DOOR_CALLS and isinstance(data, dict) else data
        rules, received = self.router.rules, self.router.clock()
        try:
            headers = headers_of(data)
            tags = request_tags(data, headers)
            caller = caller_of(user_api_key_dict, metadata_tags=rules.trust_metadata_tags)
            screened = screen(caller, rules, latency_class=headers.get(rules.latency_header.lower()), tags=tags,
                              priority=client_priority(data))  # fmt: skip
            if screened.ignored:  # before routing: a request that then goes on unrouted carries no claim either
                drop_claims(data, set(tags) - set(screened.tags), not screened.priority)
                self._count_ignored(caller.key_alias, screened.ignored)
            decision = await self.router.decide(prompt_tokens(data, self._count_text), screened.latency_class,
                                                screened.tags)  # fmt: skip
        except Exception:  # the plugin must never fail a request: route it as LiteLLM would, as standard at the door
            self.router.metrics.errors.inc()
            log.exception("batchlens routing failed for one request; it goes on unrouted")
            return with_door_priority(data, 0)
        metadata = data.setdefault("metadata", {})
        tags = metadata.get("tags")
        metadata["tags"] = [*(tags if isinstance(tags, list) else []), *decision.tags]
        if decision.route.role in ROLES:  # a door's refusal is retried within it ("any": every engine was down)
            metadata[door_retry.METADATA_KEY] = DoorRetry(decision.route.role, received)
        if decision.priority is not None:
            data["extra_body"] = {**(data.get("extra_body") or {}), "priority": decision.priority}
        return with_door_priority(data, decision.door_priority)

    def _count_ignored(self, key_alias: str | None, claims: tuple[str, ...]) -> None:
        for claim in claims:
            self.router.metrics.untrusted.labels(claim).inc()
            if claim not in self._warned:  # once per kind of claim: a tenant's every request must not flood the log
                self._warned.add(claim)
                log.warning(
                    "batchlens routing: ignored a %s claim from key %s, which is not trusted (routing.trusted_keys, "
                    "trusted_teams); counted in batchlens_routing_untrusted_claims_total",
                    claim, key_alias or "without an alias",
                )  # fmt: skip

    async def async_filter_deployments(self, model, healthy_deployments, messages, request_kwargs=None,
                                       parent_otel_span=None):  # fmt: skip
        """Each routing pass of a request (the first, LiteLLM's generic retry, its fallback hop and that hop's
        retry). Once a door refused it: the fallback hop only to the engines of its one retry; every other pass,
        nowhere (the door's 503 is raised again, and that is what the client gets)."""
        door = door_of(request_kwargs)
        if door is None or door.answer is None:
            return healthy_deployments
        try:
            engine_of = {id(d): self._engine_of(d) for d in healthy_deployments}
            settled = door.outcome
            retry = door.route(self.router.clock(), self.router.ttft_budget, self.router.roles, self.router.states(),
                               set(engine_of.values()), hop=model == self._fallback_group)  # fmt: skip
        except Exception:  # never fail a request for a bug here: it goes on as LiteLLM would route it
            self.router.metrics.errors.inc()
            log.exception("batchlens routing: the door retry failed for one request; it goes on as LiteLLM routes it")
            return healthy_deployments
        if door.outcome != settled:
            self._door_outcome(door)
        if not retry:
            raise door.answer
        metadata = request_kwargs["metadata"]  # LiteLLM's tag filtering, after this, must keep them
        tags = [t for t in metadata.get("tags") or () if not (isinstance(t, str) and t.startswith(ENGINE_TAG))]
        metadata["tags"] = [*tags, *(ENGINE_TAG + e for e in retry)]
        return [d for d in healthy_deployments if engine_of[id(d)] in retry]

    async def async_post_call_failure_deployment_hook(self, request_data, exception, call_type, fallback_depth=None):
        """One attempt failed. A door's refusal: the 503 the client gets unless the retry serves it; the retry's
        own end is counted."""
        door = door_of(request_data)
        if door is None:
            return
        answer = refusal_answer(exception) if door_retry.door_refusal(exception) else None
        if door.failed(self._engine_of(request_data), answer):
            if door.outcome == door_retry.REFUSED_AGAIN and "Retry-After" in answer.headers:
                door.answer.headers["Retry-After"] = answer.headers["Retry-After"]  # the last refusing engine's
            self._door_outcome(door)

    async def async_post_call_success_deployment_hook(self, request_data, response, call_type):
        door = door_of(request_data)
        if door is not None and door.answered():
            self._door_outcome(door)
        return None

    def _engine_of(self, deployment: Mapping) -> str | None:
        """The engine a deployment (or an attempt's kwargs, which carry its model_info) sends to."""
        info = deployment.get("model_info")
        return self._deployments.get(info.get("id")) if isinstance(info, Mapping) else None

    def _door_outcome(self, door: DoorRetry) -> None:
        """Count a door retry's outcome, and say it: at most one line per role and outcome a minute."""
        self.router.metrics.door_retries.labels(door.role, door.outcome).inc()
        key, now = (door.role, door.outcome), self.router.clock()
        last, since = self._door_lines.get(key, (None, 0))
        if last is not None and now - last < DOOR_LOG_SECONDS:
            self._door_lines[key] = (last, since + 1)
            return
        self._door_lines[key] = (now, 0)
        more = f"; {since} more since the last such line" if since else ""
        level = logging.INFO if door.outcome == door_retry.SERVED else logging.WARNING
        log.log(level, "batchlens routing: %s; counted in batchlens_routing_door_retries_total%s", door.said(), more)

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        """A call answered: its TTFT, by class, from LiteLLM's record of it (its StandardLoggingPayload)."""
        payload = kwargs.get("standard_logging_object") or {}
        wanted = wanted_of(payload.get("request_tags"))
        start, first = payload.get("startTime"), payload.get("completionStartTime")
        if wanted and isinstance(start, int | float) and isinstance(first, int | float) and first >= start:
            self.router.metrics.ttft.labels(wanted).observe(first - start)

    async def async_post_call_failure_hook(self, request_data, original_exception, user_api_key_dict,
                                           traceback_str=None):  # fmt: skip
        """The proxy answers a client with an error, after every retry and fallback (a failed attempt that a
        fallback then served is not a failure to the client, and LiteLLM's per-attempt failure event would
        count it)."""
        wanted = wanted_of((request_data.get("metadata") or {}).get("tags"))
        if wanted:
            self.router.metrics.failures.labels(wanted).inc()


def refusal_answer(exception: BaseException) -> ProxyException:
    """The 503 a client gets for a door's refusal: the engine's error as LiteLLM read it, with the engine's
    Retry-After. A ProxyException, whose headers every route of the proxy sends (from an engine's own error,
    LiteLLM 1.106 sends them only as llm_provider-retry-after, and on /v1/completions not at all)."""
    after = door_retry.retry_after(exception)
    return ProxyException(message=str(getattr(exception, "message", None) or exception), type="Service Unavailable",
                          param=None, code=503, headers={"Retry-After": after} if after else {})  # fmt: skip


routing = BatchlensRouting()
