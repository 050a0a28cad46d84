"""Sampler groups: their specs and presets (:mod:`fleet.specs`, ``fleet/presets/``) and the pure
autoscaling policy over them (:mod:`fleet.autoscale`)."""
