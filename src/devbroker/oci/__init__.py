"""devbroker for OCI container runtimes (runc, crun) and CDI: see docs/containers.md.

* :mod:`devbroker.oci.profile` - the OCI ``linux.seccomp`` sections (sans-IO), derived from
  the filters ``devbroker exec`` installs (``sandbox.seccompwire``).
* :mod:`devbroker.oci.state` - the runtime's seccomp hand-over (the OCI "container process
  state"): decoding it and naming the tenant (sans-IO).
* :mod:`devbroker.oci.cdi` - the CDI spec ``devbroker cdi`` writes (sans-IO).
* :mod:`devbroker.oci.hook` - the ``createContainer`` hook that builds the tenant's
  ``/proc/driver/nvidia``, ``/proc/devices`` and ``/sys/module`` views in the container.
* :mod:`devbroker.oci.agent` - the broker's end of ``linux.seccomp.listenerPath``.
"""
