"""Shared test setup: eight CPU devices for real meshes, before JAX is imported."""

import os

# Real multi-device meshes on CPU; must be set before jax initializes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
