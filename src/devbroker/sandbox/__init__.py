"""`devbroker exec`: run a command that sees only its tenant's broker nodes (see docs/sandbox.md)."""
from devbroker.sandbox.sandbox import (
    ROOT_CAPABILITIES, Bind, SandboxError, SandboxSpec, exec_main, run_here, run_in_sandbox,
    tenant_nodes,
)

__all__ = ["ROOT_CAPABILITIES", "Bind", "SandboxError", "SandboxSpec", "exec_main", "run_here",
           "run_in_sandbox", "tenant_nodes"]
