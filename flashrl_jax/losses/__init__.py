"""flashrl_jax.losses (filled in by its issue)."""
