"""`python -m flashrl_jax.rollout.server --model_path=DIR --port=N`: our JAX engine behind SGLang's
HTTP protocol, for CPUs and TPUs where SGLang does not run (GPU users may run real SGLang instead).

Flags become an `EngineConfig` once, here; everything else is the library. The server binds
127.0.0.1 unless `--host` says otherwise, compiles every program a step can run before it listens
(so nothing compiles mid-run: `/server_info` counts it), keeps them in JAX's persistent compilation
cache (a restart loads instead of compiling), logs how long that took, and prints one line
`flashrl_jax rollout server ready on http://HOST:PORT` when it accepts requests. On shutdown it
logs how many programs were built after warm-up (always 0 unless a shape escaped the buckets).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import jax.numpy as jnp
from absl import app, flags
from aiohttp import web

from flashrl_jax._backend import check_backend
from flashrl_jax.fleet import exit_with_launcher
from flashrl_jax.rollout._compiles import DEFAULT_CACHE_DIR, enable_compilation_cache
from flashrl_jax._gc import freeze_startup_objects
from flashrl_jax.rollout._config import EngineConfig
from flashrl_jax.rollout._engine import Engine
from flashrl_jax.rollout._openai import add_openai_routes
from flashrl_jax.rollout._server import build_app
from flashrl_jax.rollout._wire import Limits

_MODEL_PATH = flags.DEFINE_string("model_path", None, "HF checkpoint directory (safetensors).")
_TOKENIZER_PATH = flags.DEFINE_string("tokenizer_path", None,
                                      "Directory with tokenizer.json (default: model_path).")
_SERVED_NAME = flags.DEFINE_string("served_model_name", None,
                                   "Model name for the OpenAI API (default: model_path).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 30000, "Port to bind (0: pick a free one, printed).")
_MAX_RUNNING = flags.DEFINE_integer("max_running_requests", 8, "Decode slots.")
_CONTEXT = flags.DEFINE_integer("context_length", 0,
                                "Max prompt + output tokens (0: the model's, at most 4096).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and compute.")
_TP = flags.DEFINE_integer("tp", 1, "Tensor-parallel devices (the rollout mesh's `tensor` axis).")
_MAX_PREFILL_BATCH = flags.DEFINE_integer("max_prefill_batch", 4, "Prompts per prefill call.")
_MIN_PREFILL_LEN = flags.DEFINE_integer("min_prefill_len", 16, "Smallest prefill length bucket.")
_MIN_DECODE_BATCH = flags.DEFINE_integer("min_decode_batch", 1,
                                         "Smallest decode batch bucket (powers of two and the "
                                         "halfway points between them, up to the slots).")
_MIN_DECODE_SPAN = flags.DEFINE_integer("min_decode_span", 64,
                                        "Smallest attention span bucket of a decode row (powers "
                                        "of two up to the context length).")
_DECODE_STEPS = flags.DEFINE_integer(
    "num_continuous_decode_steps", EngineConfig.num_continuous_decode_steps,
    "Decode steps per device call (SGLang's flag of the same name): the fixed cost of a call is "
    "paid once per block; admissions, aborts and pauses wait for the block to end.")
_DECODE_DELAY = flags.DEFINE_float(
    "decode_delay_s", 0.0, "Seconds to sleep after each decode call: a server slow on purpose (a "
    "straggler in a fleet experiment, or a test that pauses requests mid-generation).")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 4096,
                                       "Max padded tokens per grouped prefill call.")
_WEIGHT_VERSION = flags.DEFINE_string("weight_version", "default", "Initial weight version.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds requests sent without sampling_seed.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every prefill and decode shape before "
                            "listening.")
_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_CACHE_DIR,
    "JAX persistent compilation cache, so a restart loads its programs instead of compiling them "
    "(default: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/flashrl_jax/jax; '' turns it off).")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", Limits.max_body_bytes,
                                 "Largest request body accepted (413 above).")
_MAX_TEXT = flags.DEFINE_integer("max_text_chars", Limits.max_text_chars,
                                 "Longest `text` prompt accepted, checked before tokenizing.")
_MAX_N = flags.DEFINE_integer("max_n", Limits.max_n, "Largest `n` (samples per prompt).")
_MAX_SAMPLES = flags.DEFINE_integer("max_samples_per_request", Limits.max_samples,
                                    "Most samples (prompts x n) in one /generate.")
_PLATFORM = flags.DEFINE_enum(
    "platform", None, ["cpu", "gpu", "tpu"], "The backend this server must decode on: it refuses "
    "to start on another (JAX falls back to the CPU when no accelerator is visible). Unset: "
    "whatever JAX finds. A run's local servers get `resources.platform`.")
_FAULTS = flags.DEFINE_bool("enable_fault_injection", False,
                            "Serve POST /debug/kill_engine (fault tests only).")


def _config() -> EngineConfig:
  return EngineConfig(
      model_path=_MODEL_PATH.value, tokenizer_path=_TOKENIZER_PATH.value,
      max_running_requests=_MAX_RUNNING.value, context_length=_CONTEXT.value or None,
      dtype=jnp.dtype(_DTYPE.value), tp=_TP.value, max_prefill_batch=_MAX_PREFILL_BATCH.value,
      min_prefill_len=_MIN_PREFILL_LEN.value, prefill_token_budget=_PREFILL_BUDGET.value,
      min_decode_batch=_MIN_DECODE_BATCH.value, min_decode_span=_MIN_DECODE_SPAN.value,
      num_continuous_decode_steps=_DECODE_STEPS.value, decode_delay_s=_DECODE_DELAY.value,
      weight_version=_WEIGHT_VERSION.value, seed=_SEED.value)


async def _serve(engine: Engine, args: dict) -> None:
  limits = Limits(max_body_bytes=_MAX_BODY.value, max_text_chars=_MAX_TEXT.value,
                  max_n=_MAX_N.value, max_samples=_MAX_SAMPLES.value)
  app = build_app(engine, args, limits=limits, fault_injection=_FAULTS.value)
  runner = web.AppRunner(add_openai_routes(app), handler_cancellation=True, access_log=None)
  await runner.setup()
  site = web.TCPSite(runner, _HOST.value, _PORT.value)
  await site.start()
  port = runner.addresses[0][1]
  args["port"] = port  # the app holds this dict: /server_info reports the bound port
  print(f"flashrl_jax rollout server ready on http://{_HOST.value}:{port}", flush=True)
  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGINT, signal.SIGTERM):
    loop.add_signal_handler(sig, stop.set)
  await stop.wait()
  await runner.cleanup()


def main(argv) -> None:
  del argv
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
  exit_with_launcher()  # a launcher killed with SIGKILL leaves no server running
  if _PLATFORM.value:
    check_backend(_PLATFORM.value, "this rollout server")
  if _CACHE_DIR.value:
    enable_compilation_cache(_CACHE_DIR.value)
  config = _config()
  engine = Engine(config)
  if _WARMUP.value:
    done = engine.warmup().result()
    logging.info("warm-up: %d shapes in %.1f s (%d programs built, %d of them from the persistent "
                 "cache)", done["warmup_shapes"], done["warmup_s"], done["num_compiles"],
                 done["num_compile_cache_hits"])
  freeze_startup_objects()  # warm-up's objects: never garbage, no longer walked by the collector
  args = {"model_path": config.model_path, "tokenizer_path": config.tokenizer_path,
          "served_model_name": _SERVED_NAME.value or config.model_path,
          "host": _HOST.value, "port": _PORT.value, "weight_version": config.weight_version,
          "seed": config.seed, "prefill_token_budget": config.prefill_token_budget,
          "decode_delay_s": config.decode_delay_s}  # a server slowed on purpose says so
  try:
    asyncio.run(_serve(engine, args))
  finally:
    engine.shutdown()
    compiles = engine.compiles()
    logging.info("programs built after warm-up: %s (%s)", compiles["num_compiles_after_warmup"],
                 compiles)


if __name__ == "__main__":
  flags.mark_flag_as_required("model_path")
  app.run(main)
