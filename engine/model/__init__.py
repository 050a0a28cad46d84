"""The Qwen3-MoE model of the local engine, its layers and its checkpoint loader per format."""
