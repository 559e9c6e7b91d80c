"""flashrl_jax.trainer (filled in by its issue)."""
