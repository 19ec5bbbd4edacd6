"""The batchlens admin API contract (DESIGN.md, "Admin API").

The vLLM plugin and the simulator serve it; the exporter and the remediation
hook call it. Keeping the models here means both sides validate the same shape.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

BATCH_PATH = "/batchlens/v1/batch"


class BatchState(BaseModel):
    """Reply of ``GET`` and ``PUT /batchlens/v1/batch``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    max_num_seqs: int = Field(ge=1, description="the engine's capacity (vLLM --max-num-seqs)")
    max_num_active_seqs: int = Field(ge=1, description="the admission limit in force (batchlens batch limit)")
    num_running: int = Field(ge=0)
    num_waiting: int = Field(ge=0)


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header for a token; none when no token is configured."""
    return {"Authorization": f"Bearer {token}"} if token else {}
