"""Workload-aware routing (the article's stage 2): which engine role each request should reach.

The pieces are pure and kept apart, so they can be tested without a proxy:
``classify`` (request -> role), ``gaps`` (the cold-path threshold), ``signals``
(the exporter's view of each engine), ``pick`` (role + signals -> the engines,
with fallbacks) and ``door_retry`` (where an engine door's refusal is retried,
once). The LiteLLM plugin that uses them is ``batchlens.routing.litellm_proxy``.
"""
