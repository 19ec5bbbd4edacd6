"""The LiteLLM proxy's config for the engines and their roles: what ``batchlens build`` writes. Pure.

One model group (``routing.model``) holds a deployment per engine. Each
carries the tag ``batchlens-engine:<name>``, through which the routing plugin
sends a request to the engines it picked (LiteLLM's tag filtering), and
``batchlens-role:<role>`` tags for people reading it. Where an engine's
``max_model_len`` is known, LiteLLM's context-window pre-call check keeps
longer prompts off it. The plugin and LiteLLM's Prometheus callback are
enabled; the master key comes from ``LITELLM_MASTER_KEY``, never the file.

The fallback group (``<model>-fallback``) is every engine again, untagged by
engine: when the engines a request was sent to fail (killed mid-run, before
the exporter has seen it), LiteLLM retries it there, on any engine that
answers, instead of failing it.
"""

from __future__ import annotations

from collections.abc import Iterable

from batchlens.config import Config, Engine
from batchlens.routing.router import ENGINE_TAG

#: The LiteLLM release whose proxy hook API the plugin targets; scripts/litellm-env.sh and
#: docker/litellm.Dockerfile install the same one (a test checks them).
LITELLM_VERSION = "1.106.12"
#: How batchlens runs the proxy's server (the demo, docker/litellm.Dockerfile, the tests; a test checks them). One
#: worker: the plugin's signals and counters live in its process. A keep-alive of 75 s, past the clients' (httpx
#: keeps an idle connection 5 s, aiohttp 15 s): at uvicorn's 5 s, the server closes a connection just as a client
#: reuses it, and that request is lost before the proxy sees it (issue 32).
SERVER_ARGS = ("--num_workers", "1", "--keepalive_timeout", "75")
PLUGIN = "batchlens.routing.litellm_proxy.routing"
FALLBACK_TAG = "default"  # LiteLLM's tag for deployments that take requests no other tag matched


class ProxyConfigError(ValueError):
    """The config cannot make a proxy config: the message says what to set."""


def litellm_config(config: Config) -> dict:
    model = config.routing.model
    if not model:
        raise ProxyConfigError("routing.model is not set: name the model clients ask for (vLLM's --served-model-name)")
    if not config.engines:
        raise ProxyConfigError("no engines in the config: list them, each with its role (docs/routing.md)")
    fallback = fallback_group(model)
    routed = [_deployment(model, model, e, [ENGINE_TAG + e.name, *(f"batchlens-role:{r}" for r in e.role)])
              for e in config.engines]  # fmt: skip
    spares = [_deployment(fallback, model, e, [FALLBACK_TAG]) for e in config.engines]
    return {
        "model_list": routed + spares,
        "router_settings": {
            "enable_tag_filtering": True,
            "enable_pre_call_checks": True,  # the context window: model_info.max_input_tokens
            "routing_strategy": "least-busy",  # within the engines the plugin picked
            "num_retries": 1,
            "allowed_fails": 1,
            "cooldown_time": 10,
            "fallbacks": [{model: [fallback]}],
        },
        "litellm_settings": {
            "callbacks": ["prometheus", PLUGIN],
            **({} if config.routing.metrics_auth else {"require_auth_for_metrics_endpoint": False}),
            # A key's alias (routing.trusted_keys) and its metadata tags are trust: by default LiteLLM lets any
            # user create keys of their own, with any free alias and any metadata. Only the proxy's admin does.
            "key_generation_settings": {
                "personal_key_generation": {"allowed_user_roles": ["proxy_admin"]},
                "team_key_generation": {"allowed_team_member_roles": []},
            },
        },
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
    }


def fallback_group(model: str) -> str:
    return f"{model}-fallback"


def deployment_engines(model: str, engines: Iterable[Engine]) -> dict[str, str]:
    """Each deployment's LiteLLM id (``model_info.id``, in both groups) to the name of the engine it sends to."""
    return {_deployment_id(g, e): e.name for e in engines for g in (model, fallback_group(model))}


def _deployment_id(group: str, engine: Engine) -> str:
    return f"{group}/{engine.name}"


def _deployment(group: str, served: str, engine: Engine, tags: list[str]) -> dict:
    info: dict = {"id": _deployment_id(group, engine), "batchlens_roles": list(engine.role)}
    if engine.max_model_len is not None:
        info["max_input_tokens"] = engine.max_model_len
    return {
        "model_name": group,
        "litellm_params": {"model": f"hosted_vllm/{served}", "api_base": engine.url + "/v1",
                           "tags": tags},
        "model_info": info,
    }  # fmt: skip
