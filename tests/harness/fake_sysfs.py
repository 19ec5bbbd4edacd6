"""A host's PCI bus as sysfs shows it, in a directory: the stand-in for the hardware that
batchlens.exporter.pci_bus reads (there is no NVIDIA GPU here). The layout is the kernel's:
``bus/pci/devices/<address>/{vendor,class}`` and a ``driver`` link to ``bus/pci/drivers/<name>``."""

from __future__ import annotations

from pathlib import Path

NVIDIA, INTEL = "0x10de", "0x8086"
GPU_3D, GPU_VGA, BRIDGE = "0x030200", "0x030000", "0x068000"


def pci_bus(root: Path, devices: list[tuple[str, str, str | None]]) -> Path:
    """``root`` holding a bus with ``devices``, each (vendor, class, driver or None); returns ``root``."""
    listed = root / "bus" / "pci" / "devices"
    listed.mkdir(parents=True, exist_ok=True)
    for n, (vendor, klass, driver) in enumerate(devices):
        device = listed / f"0000:{n + 0x10:02x}:00.0"
        device.mkdir()
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(klass + "\n")
        if driver is not None:
            bound = root / "bus" / "pci" / "drivers" / driver
            bound.mkdir(parents=True, exist_ok=True)
            (device / "driver").symlink_to(bound)
    return root


def gpu_host(root: Path, gpus: int) -> Path:
    """A GPU host's bus: ``gpus`` NVIDIA 3D controllers (no driver bound: it may be gone), a bridge of theirs,
    and an Intel device."""
    return pci_bus(root, [(NVIDIA, GPU_3D, None)] * gpus + [(NVIDIA, BRIDGE, None), (INTEL, BRIDGE, None)])
