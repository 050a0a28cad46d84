"""One sampler replica: the sidecar next to an engine, its weight reconciler, activation, and the
entrypoint that starts them."""
