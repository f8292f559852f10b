"""Test-wide set-up: four host CPU devices, so multi-device code runs everywhere.

XLA reads the flag when JAX initialises its backend, so it must be set before any
test imports jax. Single-device behaviour is tested on a one-device mesh.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests build a fresh DpsgdStep (fresh jit closures) around the same program;
# JAX's persistent compilation cache, keyed on the compiled program, lets them
# share compilations across tests and across pytest-xdist workers.
import tempfile  # noqa: E402

import jax  # noqa: E402

jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("DPSCALE_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "dpscale-test-jax-cache")),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
