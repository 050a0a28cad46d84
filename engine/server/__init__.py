"""The local engine's HTTP surface: SGLang's routes, request shapes, metrics, tokenizer."""
