"""The agentic demo played by ordinary agent code through the OpenAI API.

Same task, servers and trainer as `agentic.py`, but each episode is `controller.chat_agent`: plain
code that sends the observation as a user message with `openai.AsyncOpenAI(...).chat.completions
.create(...)` and plays the reply as its action, against a base URL the controller gives it. The
controller's recording proxy renders the policy's chat template, generates through the fleet (so
staleness, pauses and weight handoffs work as for the controller's own episodes), records every
turn's token ids, behaviour log-probs and weight versions, and trains on the assembled multi-turn
trajectories. `python -m experiments.train --config=experiments/configs/agentic_openai.py`.
"""

import dataclasses

from flashrl_jax.controller import AgentPolicy, RunConfig

from experiments.configs import agentic


def get_config() -> RunConfig:
  config = agentic.get_config()
  return dataclasses.replace(config, workdir="runs/agentic_openai",
                             agentic=dataclasses.replace(config.agentic, policy=AgentPolicy.OPENAI))
