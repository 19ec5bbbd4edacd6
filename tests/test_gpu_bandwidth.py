"""Peak memory bandwidth from bus width and clock, checked against data sheets. Pure; no fakes."""

from __future__ import annotations

import pytest

from batchlens.exporter.gpu_bandwidth import computed_bandwidth, datasheet_bandwidth, peak_bandwidth

# (NVML device name, memory bus width in bits, max memory clock in MHz as NVML reports it, data sheet bytes/s)
BOARDS = [
    ("NVIDIA A100-SXM4-40GB", 5120, 1215, 1.555e12),
    ("NVIDIA A100-PCIE-40GB", 5120, 1215, 1.555e12),
    ("NVIDIA A100-SXM4-80GB", 5120, 1593, 2.039e12),
    ("NVIDIA A100 80GB PCIe", 5120, 1512, 1.935e12),
    ("NVIDIA H100 80GB HBM3", 5120, 2619, 3.35e12),
    ("NVIDIA H100 PCIe", 5120, 1593, 2.0e12),
    ("NVIDIA H200", 6144, 3201, 4.8e12),
    ("NVIDIA L40S", 384, 9001, 864e9),
    ("NVIDIA L4", 192, 6251, 300e9),
    ("Tesla T4", 256, 5001, 320e9),
]


@pytest.mark.parametrize(("name", "bus", "clock", "sheet"), BOARDS)
def test_the_formula_matches_every_data_sheet_within_ten_percent(name, bus, clock, sheet) -> None:
    assert datasheet_bandwidth(name) == sheet
    peak = peak_bandwidth(name, bus, clock)
    assert peak == (bus * clock * 1e6 * 2 / 8, "bus")
    assert abs(peak.bytes_per_second - sheet) <= 0.10 * sheet


@pytest.mark.parametrize(("name", "bus", "clock", "sheet"), BOARDS)
def test_a_misreported_clock_or_width_falls_back_to_the_data_sheet(name, bus, clock, sheet) -> None:
    assert peak_bandwidth(name, bus, clock // 2) == (sheet, "datasheet")
    assert peak_bandwidth(name, None, clock) == (sheet, "datasheet")
    assert peak_bandwidth(name, 0, 0) == (sheet, "datasheet")


def test_an_unknown_gpu_keeps_the_computed_figure_or_says_unknown() -> None:
    assert peak_bandwidth("NVIDIA RTX 6000 Ada Generation", 384, 10001) == (384 * 10001e6 * 2 / 8, "bus")
    assert peak_bandwidth("NVIDIA RTX 6000 Ada Generation", None, None) == (None, "unknown")
    assert computed_bandwidth(0, 1000) is None


def test_similar_names_do_not_match_each_other() -> None:
    assert datasheet_bandwidth("NVIDIA L4") != datasheet_bandwidth("NVIDIA L40S")
    assert datasheet_bandwidth("NVIDIA L40") is None
    assert datasheet_bandwidth("NVIDIA H100 NVL") == 3.9e12
    assert datasheet_bandwidth("NVIDIA H200 NVL") == 4.8e12
