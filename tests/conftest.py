"""Test-wide set-up: four host CPU devices, so multi-device code runs everywhere.

XLA reads the flag when JAX initialises its backend, so it must be set before any
test imports jax. Single-device behaviour is tested on a one-device mesh.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
