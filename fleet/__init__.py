"""Sampler groups: specs and presets, the sidecar, capacity, and the ``mixfleet`` CLI."""
