"""flashrl_jax.controller (filled in by its issue)."""
