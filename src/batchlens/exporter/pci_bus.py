"""How many NVIDIA GPUs this host's PCI bus holds, read from sysfs: the hardware's answer, with or without a
driver.

NVML can only say what its driver sees. A host whose driver died or was unloaded answers NVML exactly as a CPU
host does (``batchlens_nvml_driver_present 0``), and only one of the two is a page. The bus tells them apart:
its devices are listed under ``/sys/bus/pci/devices`` whether a driver is bound or not, and sysfs shows the
host's bus inside a container too. A GPU handed to another driver (``vfio-pci``, passed through to a virtual
machine) is not this host's to serve and is not counted.
"""

from __future__ import annotations

from pathlib import Path

NVIDIA = "0x10de"
DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA-compatible and 3D controllers: the GPUs, not NVIDIA's bridges
OWN_DRIVERS = ("nvidia",)


def nvidia_gpus(sysfs: Path = Path("/sys")) -> int | None:
    """NVIDIA GPUs on the bus that are the NVIDIA driver's or no driver's; None where sysfs cannot be read."""
    devices = sysfs / "bus" / "pci" / "devices"
    try:
        entries = list(devices.iterdir())
    except OSError:
        return None
    count = 0
    for device in entries:
        try:
            if (device / "vendor").read_text().strip() != NVIDIA:
                continue
            if not (device / "class").read_text().strip().startswith(DISPLAY_CLASSES):
                continue
        except OSError:  # a device removed while we read: not on the bus
            continue
        driver = device / "driver"
        if not driver.exists() or driver.resolve().name in OWN_DRIVERS:
            count += 1
    return count
