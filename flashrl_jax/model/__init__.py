"""flashrl_jax.model (filled in by its issue)."""
