"""flashrl_jax: asynchronous RL post-training of LLMs in JAX/Flax (a ROLL Flash reimplementation).

Sub-packages, one concept each: `model` (decoder LM + HF I/O), `losses` (policy objectives,
advantages, KL), `trainer` (sharded jit step, optimizer, checkpoints, weight export), `rollout`
(JAX engine, SGLang-protocol server and client), `controller` (async/sync RL loop), `envs`
(rewards and environments), `testing` (tiny models and fixtures for tests and demos).
"""
