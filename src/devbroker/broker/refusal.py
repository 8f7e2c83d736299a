"""Refusal: a decision to refuse a call, raised by the core, its handlers and the rewrite hooks."""
from __future__ import annotations

import errno
from dataclasses import dataclass


class Refusal(Exception):
    """A decision to refuse a call; carries both the errno and the driver status forms."""

    def __init__(self, reason: str, *, errno_: int = errno.EPERM, status: int | None = None,
                 what: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.errno = errno_
        self.status = status
        self.what = what


# ------------------------------------------------------------------------------------------
# What each kind of refusal answers, and what CUDA and NVML make of it: the table in
# docs/security.md ("Refusals: what each one answers", `answers_markdown`), and the answers
# tests/test_managed.py checks against the emulated driver. A refusal answers what the
# driver itself answers for that condition, so that a program reports it as it would
# natively (out of memory, not permitted, invalid argument), never an unknown error.
@dataclass(frozen=True)
class Answer:
    refusal: str  # the condition
    answer: str  # errno name (the ioctl's or mmap's return) or NV status (its status field)
    cuda: str  # what CUDA (and the frameworks on it) report
    nvml: str  # what NVML / nvidia-smi report ("-": NVML never makes the call)
    shown: str  # where that was seen


ANSWERS: dict[str, Answer] = {
    "quota": Answer(
        "device memory beyond the tenant's quota (RM_ALLOC / NV_ESC_RM_ALLOC_MEMORY of "
        "device memory, CUDA contexts, cuMemCreate, cudaMallocAsync pools)",
        "NV_ERR_NO_MEMORY", "cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY (PyTorch "
        "OutOfMemoryError, \"CUDA error: out of memory\")", "-",
        "the H200 (docs/hardware.md); CI"),
    "managed": Answer(
        "a managed (nvidia-uvm) mapping beyond the quota", "ENOMEM",
        "what libcuda makes of the driver's own ENOMEM from that mmap (uvm_mmap answers "
        "it when it cannot make a range): cudaErrorMemoryAllocation expected; the H200 run "
        "measures every errno natively (scripts/gpu/run-h200-uvm.sh)", "-",
        "CI (the errno); CUDA's error: the H200 run"),
    "pinned": Answer(
        "pinned host memory beyond pinned_host_memory (system-memory and OS-descriptor "
        "allocations: cudaHostAlloc, cudaHostRegister)", "NV_ERR_NO_MEMORY",
        "cudaErrorMemoryAllocation expected (the driver's answer when it cannot pin)", "-",
        "CI; CUDA's error: the H200 run"),
    "escape": Answer(
        "an escape no tenant may make (RM_ACCESS_REGISTRY, I2C, SHARE, ...)", "EPERM",
        "the driver's answer to an unprivileged caller (CUDA makes none of these)",
        "-", "CI"),
    "class": Answer(
        "an RM class not on the allowlist or not granted (debugger, profiler, capability "
        "classes)", "NV_ERR_INSUFFICIENT_PERMISSIONS",
        "as for a process without the privilege (CUDA itself allocates none of these)",
        "NVML_ERROR_NO_PERMISSION", "CI"),
    "control": Answer(
        "an RM control not on the allowlist, or one the driver reserves for privileged "
        "callers", "NV_ERR_INSUFFICIENT_PERMISSIONS", "as for an unprivileged process",
        "NVML_ERROR_NO_PERMISSION (nvidia-smi: \"Insufficient Permissions\")", "CI"),
    "foreign": Answer(
        "another tenant's client or object handle", "NV_ERR_INVALID_CLIENT / "
        "NV_ERR_INVALID_OBJECT_HANDLE", "as for a handle of another process natively",
        "as natively", "CI (escape harness), the H200"),
    "gpu": Answer(
        "opening a GPU node that is not the tenant's", "EACCES", "the GPU is not "
        "enumerated (not in cudaGetDeviceCount)", "not listed", "CI, the H200"),
    "limits": Answer(
        "the tenant's RM client or object limit (limits.rm_clients, rm_objects)",
        "NV_ERR_INSUFFICIENT_RESOURCES", "as when the driver runs out of them natively",
        "as natively", "CI"),
    "files": Answer("the tenant's open-files limit (limits.open_files)", "EMFILE",
                    "as the process's own file limit", "as natively", "CI"),
    "malformed": Answer(
        "a malformed argument (size, layout, a pointer inside a parameter block)",
        "EINVAL / NV_ERR_INVALID_ARGUMENT", "as natively (the driver checks the same)",
        "as natively", "CI (fuzzing)"),
    "memory": Answer("tenant memory the broker cannot read or write (nested buffers)",
                     "EFAULT", "as natively", "as natively", "CI"),
    "file": Answer("an ioctl or mmap of an NVIDIA file the broker did not give out",
                   "EPERM", "fails as an unprivileged call", "-", "CI, the H200"),
    "revoked": Answer(
        "a tenant removed from the policy, or a GPU taken away, while its files are open",
        "EACCES", "every later call fails (on purpose: the tenant's processes are being "
        "ended)", "every later call fails", "CI"),
    "internal": Answer("an internal error of the broker (a bug costs one call)", "EIO",
                       "cudaErrorUnknown (on purpose: loud, with an `error` audit record)",
                       "NVML_ERROR_UNKNOWN", "CI"),
}


def answers_markdown() -> str:
    """The table of ANSWERS, as docs/security.md carries it."""
    out = ["| refusal | answer | CUDA | NVML | seen |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {a.refusal} | `{a.answer}` | {a.cuda} | {a.nvml} | {a.shown} |"
            for a in ANSWERS.values()]
    return "\n".join(out) + "\n"
