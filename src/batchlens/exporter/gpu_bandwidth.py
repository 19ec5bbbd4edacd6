"""A GPU's peak memory bandwidth: computed from the bus, checked against known GPUs. Pure.

NVML has no call for peak bandwidth. The bus width times the maximum memory
clock times two (double data rate) gives it in bits per second; NVML reports
the effective clock for GDDR and HBM alike, so one formula serves both. A
driver can still report a clock or width that makes the product wrong (a MIG
or vGPU profile, an odd SKU), so for GPUs whose data sheet we know, a result
more than 10% off the sheet is replaced by the sheet's figure.
"""

from __future__ import annotations

import re
from typing import NamedTuple

#: How far the computed figure may stray from the data sheet before the sheet wins.
TOLERANCE = 0.10

# (pattern over the NVML device name, bytes/s from NVIDIA's data sheet). Order
# matters: the first match wins, so the more specific names come first.
KNOWN_GPUS: tuple[tuple[re.Pattern[str], float], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), bandwidth)
    for pattern, bandwidth in (
        (r"\bA100\b.*\b80\s?GB\b.*\bPCIe\b", 1.935e12),  # "NVIDIA A100 80GB PCIe"
        (r"\bA100\b.*\b80\s?GB\b", 2.039e12),  # "NVIDIA A100-SXM4-80GB"
        (r"\bA100\b", 1.555e12),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
        (r"\bH100\b.*\bPCIe\b", 2.0e12),  # "NVIDIA H100 PCIe"
        (r"\bH100\b.*\bNVL\b", 3.9e12),  # "NVIDIA H100 NVL"
        (r"\bH100\b", 3.35e12),  # "NVIDIA H100 80GB HBM3" (SXM5)
        (r"\bH200\b", 4.8e12),  # "NVIDIA H200", "NVIDIA H200 NVL"
        (r"\bL40S\b", 864e9),  # "NVIDIA L40S"
        (r"\bL4\b", 300e9),  # "NVIDIA L4"
        (r"\bT4\b", 320e9),  # "Tesla T4"
    )
)


class PeakBandwidth(NamedTuple):
    bytes_per_second: float | None
    #: Where the figure comes from: "bus" (bus width x clock), "datasheet"
    #: (the table above), or "unknown" (neither is available).
    basis: str


def computed_bandwidth(bus_width_bits: int | None, max_memory_clock_mhz: int | None) -> float | None:
    """Bus width x maximum memory clock x 2 (double data rate) / 8, in bytes/s."""
    if not bus_width_bits or not max_memory_clock_mhz:
        return None
    return bus_width_bits * max_memory_clock_mhz * 1e6 * 2 / 8


def datasheet_bandwidth(gpu_name: str) -> float | None:
    for pattern, bandwidth in KNOWN_GPUS:
        if pattern.search(gpu_name):
            return bandwidth
    return None


def peak_bandwidth(gpu_name: str, bus_width_bits: int | None, max_memory_clock_mhz: int | None) -> PeakBandwidth:
    computed = computed_bandwidth(bus_width_bits, max_memory_clock_mhz)
    sheet = datasheet_bandwidth(gpu_name)
    if sheet is not None and (computed is None or abs(computed - sheet) > TOLERANCE * sheet):
        return PeakBandwidth(sheet, "datasheet")
    if computed is not None:
        return PeakBandwidth(computed, "bus")
    return PeakBandwidth(None, "unknown")
