"""Run a JAX script in a child process that sees `n` CPU devices (XLA reads the device count
once, at start-up, so a test process cannot change its own)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_on_host_devices(script: str, n: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc
