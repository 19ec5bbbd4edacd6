"""The llm-d endpoint picker's config for the same engines and thresholds, for Kubernetes users. Pure.

llm-d's router (the Gateway API Inference Extension's endpoint picker) is the
Kubernetes-native alternative to the LiteLLM proxy. Of the article's split it
carries the long-prompt instance: its ``context-length-aware`` scorer reads
each pod's ``llm-d.ai/context-length-range`` label and, with filtering on,
keeps a prompt off pods whose range does not cover it. Its queue and KV-cache
scorers stand where batchlens' saturation signals stand in the plugin. The
latency class maps to an InferenceObjective's priority (a Kubernetes object,
outside this file), and the cold path has no counterpart there.

Each engine's pods need the label this returns for it (``pod_labels``).
"""

from __future__ import annotations

from batchlens.config import Config, Engine

RANGE_LABEL = "llm-d.ai/context-length-range"
#: The upper end of a long engine's range when its max_model_len is not configured.
LONGEST = 131072


def epp_config(config: Config) -> dict:
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "single-profile-handler"},
            {"type": "context-length-aware", "parameters": {"label": RANGE_LABEL, "enableFiltering": True}},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "context-length-aware", "weight": 2},
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def context_range(engine: Engine, long_prompt_tokens: int) -> str:
    """The token range an engine's pods declare: prompts over the bound for a long-only engine, else up to it."""
    top = engine.max_model_len or LONGEST
    if engine.role == ("long",):
        return f"{long_prompt_tokens + 1}-{top}"
    return f"0-{top if 'long' in engine.role else long_prompt_tokens}"


def pod_labels(config: Config) -> dict[str, dict[str, str]]:
    """engine name -> the labels its pods need for the context-length-aware scorer."""
    bound = config.routing.long_prompt_tokens
    return {e.name: {RANGE_LABEL: context_range(e, bound)} for e in config.engines}
