"""flashrl_jax.rollout (filled in by its issue)."""
