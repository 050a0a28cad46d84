"""The words every package shares: the user-facing error, the weight-format names (``formats``),
JSON, metric declarations (``metric_defs``; SGLang's engine families in ``sglang_metrics``), ports,
and the pinned SGLang release's protocol values. Imports nothing of the project outside core."""
