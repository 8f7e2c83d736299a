"""The kinds of NVIDIA device node (1-3 match the nvtrace open record; its 4 is "other")."""
from __future__ import annotations

import enum


class NodeKind(enum.IntEnum):
    CTL = 1  # /dev/nvidiactl, char 195:255
    GPU = 2  # /dev/nvidiaN, char 195:N
    UVM = 3  # /dev/nvidia-uvm
    UVM_TOOLS = 4  # /dev/nvidia-uvm-tools
    CAP = 5  # /dev/nvidia-caps/nvidia-capN
    OTHER = 6

    @classmethod
    def from_path(cls, path: str) -> "NodeKind":
        name = path.rsplit("/", 1)[-1]
        if name == "nvidiactl":
            return cls.CTL
        if name == "nvidia-uvm":
            return cls.UVM
        if name == "nvidia-uvm-tools":
            return cls.UVM_TOOLS
        if name.startswith("nvidia-cap"):
            return cls.CAP
        if name.startswith("nvidia") and name[6:].isdigit():
            return cls.GPU
        return cls.OTHER
