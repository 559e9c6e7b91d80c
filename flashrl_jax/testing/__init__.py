"""flashrl_jax.testing (filled in by its issue)."""
