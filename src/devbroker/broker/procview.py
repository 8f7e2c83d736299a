"""The tenant's view of /proc/driver/nvidia: only its GPUs, and device files left alone.

NVML reads `params` before touching /dev: with `ModifyDeviceFiles: 1` (or no file at all)
nvidia-smi creates /dev/nvidiactl itself with mknod (BRIEF §7). The view therefore always
says `ModifyDeviceFiles: 0`, as gVisor's nvproxy does for the same reason.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

HOST_PROC = Path("/proc/driver/nvidia")

# The parameters the driver prints, in its order; values of an ordinary install. Only
# ModifyDeviceFiles matters to clients here; the rest is there so that tools that parse the
# file find every key they expect.
_PARAMS = [
    ("ResmanDebugLevel", "4294967295"), ("RmLogonRC", "1"), ("ModifyDeviceFiles", "0"),
    ("DeviceFileUID", "0"), ("DeviceFileGID", "0"), ("DeviceFileMode", "438"),
    ("InitializeSystemMemoryAllocations", "1"), ("UsePageAttributeTable", "4294967295"),
    ("EnableMSI", "1"), ("EnablePCIeGen3", "0"), ("MemoryPoolSize", "0"),
    ("KMallocHeapMaxSize", "0"), ("VMallocHeapMaxSize", "0"), ("IgnoreMMIOCheck", "0"),
    ("EnableStreamMemOPs", "0"), ("EnableUserNUMAManagement", "1"), ("NvLinkDisable", "0"),
    ("RmProfilingAdminOnly", "1"), ("PreserveVideoMemoryAllocations", "0"),
    ("EnableS0ixPowerManagement", "0"), ("S0ixPowerManagementVideoMemoryThreshold", "256"),
    ("DynamicPowerManagement", "3"), ("DynamicPowerManagementVideoMemoryThreshold", "200"),
    ("RegisterPCIDriver", "1"), ("EnablePCIERelaxedOrderingMode", "0"),
    ("EnableResizableBar", "0"), ("EnableGpuFirmware", "18"), ("EnableGpuFirmwareLogs", "2"),
    ("RmNvlinkBandwidthLinkCount", "0"), ("EnableDbgBreakpoint", "0"),
    ("OpenRmEnableUnsupportedGpus", "1"), ("DmaRemapPeerMmio", "1"),
    ("ImexChannelCount", "2048"), ("CreateImexChannel0", "0"), ("GrdmaPciTopoCheckOverride", "0"),
    ("CoherentGPUMemoryMode", '""'), ("RegistryDwords", '""'), ("RegistryDwordsPerDevice", '""'),
    ("RmMsg", '""'), ("GpuBlacklist", '""'), ("TemporaryFilePath", '""'),
    ("ExcludedGpus", '""'),
]


def params_text(host_text: str | None = None) -> str:
    if host_text:
        lines = []
        for line in host_text.splitlines():
            key = line.split(":", 1)[0].strip()
            lines.append("ModifyDeviceFiles: 0" if key == "ModifyDeviceFiles" else line)
        return "\n".join(lines) + "\n"
    return "".join(f"{k}: {v}\n" for k, v in _PARAMS)


def version_text(driver_version: str) -> str:
    return (f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver_version}  "
            "Release Build  (devbroker emulation)\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1)\n")


def information_text(gpu: Any) -> str:
    return (f"Model: \t\t {gpu.name}\n"
            "IRQ:   \t\t 0\n"
            f"GPU UUID: \t {gpu.uuid}\n"
            "Video BIOS: \t ??.??.??.??.??\n"
            "Bus Type: \t PCIe\n"
            "DMA Size: \t 52 bits\n"
            "DMA Mask: \t 0xfffffffffffff\n"
            f"Bus Location: \t {gpu.pci_bus_id}\n"
            f"Device Minor: \t {gpu.index}\n"
            "GPU Firmware: \t N/A\n"
            "GPU Excluded:\t No\n")


def tenant_view(gpus: list[Any], tenant_gpus: tuple[int, ...], driver_version: str,
                *, host: Path | None = None) -> dict[str, bytes]:
    """Files under proc/driver/nvidia for one tenant, as {relative path: content}.

    With `host` (the real backend) the host's own files are the source, filtered; without
    it (the emulated backend) they are generated from the emulated GPUs.
    """
    files: dict[str, bytes] = {}
    host_params = _read(host / "params") if host else None
    files["params"] = params_text(host_params).encode()
    host_version = _read(host / "version") if host else None
    files["version"] = (host_version or version_text(driver_version)).encode()
    for i in tenant_gpus:
        if i >= len(gpus):
            continue
        g = gpus[i]
        bus = g.pci_bus_id.lower()
        info = _read(host / "gpus" / bus / "information") if host else None
        files[f"gpus/{bus}/information"] = (info or information_text(g)).encode()
    files["capabilities/mig/config"] = b"DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 0\n"
    files["capabilities/mig/monitor"] = b"DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 0\n"
    return files


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
