"""The batchlens plugin for vLLM: an admin API that changes a running server's batch limit.

Two entry points, both named ``batchlens`` so that ``VLLM_PLUGINS=batchlens``
loads both (once set, VLLM_PLUGINS is an allowlist for every plugin group):

- ``vllm.general_plugins`` -> :func:`register`: loaded in every vLLM process;
  in the EngineCore it adds the utility methods that read and set the
  scheduler's admission limit (engine_side.py).
- ``vllm.endpoint_plugins`` -> :func:`endpoint`: loaded in the API server of
  vLLM 0.32 and later; it serves ``/batchlens/v1/*`` over those methods
  (endpoint.py). Older releases have no endpoint plugins: there vLLM's
  ``--middleware`` option loads middleware.py, which serves the same routes.

Both look at this vLLM's code first (compat.py) to pick how to cap admission
(admission.py), and step aside, logging why, when they find no shape they know.
Neither can break vLLM's startup.
"""

from __future__ import annotations

import logging

log = logging.getLogger("batchlens.vllm_plugin")


def register() -> None:
    """The general plugin: install the engine-side methods, if this vLLM is one we know."""
    try:
        from batchlens.vllm_plugin.engine_side import install

        install()
    except Exception:  # a plugin must never stop vLLM from starting
        log.exception("batchlens: the engine side of the admin API could not be installed; vLLM runs without it")


def endpoint():
    """The endpoint plugin factory: vLLM calls it with no arguments."""
    from batchlens.vllm_plugin.endpoint import BatchlensEndpoint

    return BatchlensEndpoint()
