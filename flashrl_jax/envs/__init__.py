"""flashrl_jax.envs (filled in by its issue)."""
