"""devbroker.abi: the NVIDIA driver ABI, sans-IO (Contract 1 in docs/design.md).

    from devbroker.abi import registry, NodeKind
    abi = registry.get("580.159.04")
    call = abi.decode_ioctl(NodeKind.CTL, cmd, arg_bytes)
    ref = abi.nested(call)          # NestedRef(ptr, size, spec, field) or None
"""
from . import registry, status
from .driver import DriverABI, IoctlCall, NestedRef, OpSpec, iowr
from .errors import DecodeError, UnknownVersion
from .ioc import ioc_nr, ioc_size, ioc_type
from .nodes import NodeKind
from .spec import Field, StructSpec, StructValue

__all__ = [
    "DecodeError", "DriverABI", "Field", "IoctlCall", "NestedRef", "NodeKind", "OpSpec",
    "StructSpec", "StructValue", "UnknownVersion", "ioc_nr", "ioc_size", "ioc_type", "iowr",
    "registry", "status",
]
