"""The engine side of the admin API: utility methods added to vLLM's EngineCore.

They run in the EngineCore process, on its busy loop, between scheduler steps,
so a change never races a step. The API server reaches them with
``engine_client.engine_core.call_utility_all_async(name, *args)``.

Only admission into the running batch is ever changed, through the mechanism
compat.py found (admission.py). ``max_num_running_reqs`` is the model runner's
slot count: it keeps its startup value outside ``schedule()`` on every release.
"""

from __future__ import annotations

import logging
from typing import Any

from batchlens.vllm_plugin.admission import ADAPTERS
from batchlens.vllm_plugin.compat import check_installed_vllm

log = logging.getLogger("vllm.batchlens")  # under vLLM's logger, so it lands in vLLM's log

BATCH_UTILITY = "batchlens_batch"
INFO_UTILITY = "batchlens_info"
ADAPTER_ATTR = "batchlens_admission"  # on EngineCore: the admission adapter install() chose


def _rank(engine_core: Any) -> int:
    # EngineCoreProc numbers its engine cores; a plain in-process EngineCore is the only one.
    return int(getattr(engine_core, "engine_index", 0) or 0)


def batchlens_batch(engine_core: Any, limit: int | None = None) -> dict[str, int]:
    """This engine's batch state; with ``limit``, set the admission limit first."""
    scheduler = engine_core.scheduler
    adapter = getattr(engine_core, ADAPTER_ATTR)
    if limit is not None:
        capacity = scheduler.max_num_running_reqs
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= capacity:
            raise ValueError(f"max_num_active_seqs must be an integer in 1..{capacity}, got {limit!r}")
        previous = adapter.limit(scheduler)
        adapter.set_limit(scheduler, limit)
        if previous != limit:
            log.debug("batchlens: engine %d: max_num_active_seqs %d -> %d", _rank(engine_core), previous, limit)
    running, waiting = scheduler.get_request_counts()
    return {
        "engine": _rank(engine_core),
        "max_num_seqs": scheduler.max_num_running_reqs,
        "max_num_active_seqs": adapter.limit(scheduler),
        "num_running": running,
        "num_waiting": waiting,
    }


def batchlens_info(engine_core: Any) -> dict[str, int | str | None]:
    """The limits that do not change while the server runs."""
    config = engine_core.vllm_config
    return {
        "max_num_seqs": engine_core.scheduler.max_num_running_reqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "block_size": config.cache_config.block_size,
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "admission": getattr(engine_core, ADAPTER_ATTR).name,
    }


def install() -> bool:
    """Add the utility methods to EngineCore, with the admission mechanism this vLLM offers, if any."""
    support = check_installed_vllm()
    if support.mechanism is None:
        # Every vLLM process loads general plugins; the API server's side says it once, loudly.
        log.debug("batchlens: engine side not installed: %s", support.refusal)
        return False
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    adapter = ADAPTERS[support.mechanism]
    adapter.install(Scheduler)
    setattr(EngineCore, ADAPTER_ATTR, adapter)
    EngineCore.batchlens_batch = batchlens_batch
    EngineCore.batchlens_info = batchlens_info
    return True
