"""What a failing GPU says, and what batchlens calls it: the Xid codes it knows, the clock-event reasons of a
GPU that slows itself down, and the alerts of a GPU in trouble. Pure; shared by the exporter (which counts
Xids by these codes), the rules (which page on them) and the hook (which will not halve a batch for them)."""

from __future__ import annotations

from collections.abc import Mapping

#: Xids that mean the GPU or its memory failed, not the program on it: a page, and the GPU leaves service.
#: From NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors) and the codes the Kubernetes device plugin
#: marks a GPU unhealthy on.
CRITICAL_XIDS: Mapping[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "the GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
#: Xids that are most often the application's (an illegal address, a killed process): counted by code, no page.
APPLICATION_XIDS: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, a process was killed",
    68: "video processor exception",
    109: "context switch timeout",
}
OTHER = "other"

# The clock-event reasons of a GPU that slows itself down (its own protection, a failing fan or power supply),
# not a power cap it was given: sw_power_cap is how a busy GPU runs, and no fault.
THROTTLE_REASONS = "hw_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown|sw_thermal_slowdown"
# The alerts of a GPU in trouble, each labelled with the engine it serves: while one fires (or is pending) for an
# engine, the hook does not halve its batch for a P99 breach (a smaller batch does not mend a GPU), and the
# controller learns nothing from its windows.
GPU_FAULT_ALERTS = ("BatchlensGpuLost", "BatchlensGpuXidCritical", "BatchlensGpuEccUncorrectable",
                    "BatchlensGpuRowRemapFailed", "BatchlensGpuThrottled")  # fmt: skip


def xid_label(xid: int) -> str:
    """The ``xid`` label: the code where batchlens knows it, else ``other`` (a bounded label set)."""
    return str(xid) if xid in CRITICAL_XIDS or xid in APPLICATION_XIDS else OTHER


def critical_pattern() -> str:
    """The critical codes as a PromQL regular expression, for the alert."""
    return "|".join(str(code) for code in CRITICAL_XIDS)
