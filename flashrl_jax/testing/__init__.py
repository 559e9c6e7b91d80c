"""Tiny models and fixtures shared by tests, demos and benchmarks (no downloads)."""

from flashrl_jax.testing._tiny import tiny_config, tiny_model, write_tiny_checkpoint

__all__ = ["tiny_config", "tiny_model", "write_tiny_checkpoint"]
