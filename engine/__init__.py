"""The local CPU sampler engine: a Qwen3-MoE model (``model``), its checkpoint loading
(``weights``), KV caches (``cache``), ``mixfleet init-model`` (``init_model``) and the
SGLang-compatible server built on top of them.

Importing this package is cheap (no torch); import the submodules you need.
"""
