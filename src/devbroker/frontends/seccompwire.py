"""The seccomp codec's former home, kept only for frontends/seccomp.py's import.

The codec is sandbox/seccompwire.py (the sandbox, the stat shim and the OCI profile build
their filters with it, and the sandbox sits below the front ends). Remove this module once
frontends/seccomp.py imports `devbroker.sandbox.seccompwire` itself.
"""
from devbroker.sandbox.seccompwire import *  # noqa: F401,F403
