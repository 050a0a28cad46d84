"""The words every package shares: the user-facing error, JSON, metric declarations, ports,
and the pinned SGLang release's protocol values. Imports nothing of the project."""
