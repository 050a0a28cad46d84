"""Sampler groups: specs and presets, the engine client, the sidecar, capacity, the embedded fleet."""
