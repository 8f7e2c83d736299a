"""Helpers for tests that need more than the host kernel (QEMU guests)."""
