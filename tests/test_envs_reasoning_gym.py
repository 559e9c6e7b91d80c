"""reasoning-gym as an RLVR task: configs fail clearly, the reward is the library's own score, the
stream is deterministic and resumes exactly, held-out sets never leak into training, and the step
metrics break reward and accuracy down per dataset."""

import asyncio

import pytest
import reasoning_gym

from flashrl_jax import envs
from flashrl_jax.controller import Group, PromptSource, Response, TaskConfig, step_sample_metrics
from flashrl_jax.envs import AnswerFormat, ReasoningGymConfig, ReasoningGymDataset

EASY = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
            allow_parentheses=False, allow_negation=False)


def test_unknown_dataset_names_its_neighbours():
  with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset 'chain_summ'.*'chain_sum'"):
    ReasoningGymDataset("chain_summ")
  with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'composite'"):
    ReasoningGymDataset("composite")  # mixing is the task's job (weights), not a dataset's


def test_unknown_or_bad_params_fail_with_the_accepted_fields():
  with pytest.raises(ValueError, match=r"no parameter\(s\) \['max_term'\].*'max_terms'"):
    ReasoningGymDataset("chain_sum", params={"max_term": 3})
  with pytest.raises(ValueError, match=r"no parameter\(s\) \['seed'\]"):
    ReasoningGymDataset("chain_sum", params={"seed": 3})  # the task seeds its generators
  with pytest.raises(ValueError, match="rejects params.*max_terms must be >= min_terms"):
    ReasoningGymDataset("basic_arithmetic", params={"min_terms": 4, "max_terms": 2})
  with pytest.raises(ValueError, match="weight must be > 0"):
    ReasoningGymDataset("chain_sum", weight=0)
  with pytest.raises(ValueError, match="twice"):
    ReasoningGymConfig(datasets=(ReasoningGymDataset("chain_sum"), ReasoningGymDataset("chain_sum")))
  with pytest.raises(ValueError, match="answer_format='boxed' is not one of"):
    ReasoningGymConfig(datasets=(ReasoningGymDataset("chain_sum"),), answer_format="boxed")
  with pytest.raises(TypeError, match="unexpected keyword argument 'wieght'"):
    ReasoningGymDataset("chain_sum", wieght=2)


def test_task_config_scores_reasoning_gym_with_its_own_scorer():
  rg = ReasoningGymConfig(datasets=(ReasoningGymDataset("chain_sum"),))
  assert TaskConfig(reasoning_gym=rg).reward is envs.RewardKind.REASONING_GYM
  with pytest.raises(ValueError, match="scored by reasoning-gym"):
    TaskConfig(reasoning_gym=rg, reward="math")
  with pytest.raises(ValueError, match="exactly one of"):
    TaskConfig(reasoning_gym=rg, synthetic=envs.SyntheticConfig())


# (dataset, params, responses built from the oracle answer `a`): right, wrong, partial credit, junk.
CASES = [
    ("basic_arithmetic", EASY, lambda a: [a, a + "0", f" {a} and more", "", "\n" + a]),
    ("chain_sum", {}, lambda a: [a, "-" + a, a + ".0", "x"]),
    ("leg_counting", {}, lambda a: [a, str(int(a) + 1), f"{a} legs"]),
    ("letter_counting", {}, lambda a: [a, str(int(a) + 2), "many"]),
    ("number_sorting", {}, lambda a: [a, a.replace(",", ";"), "[]"]),
    ("propositional_logic", {}, lambda a: [a, "P", "¬(P ∧ Q)"]),
]


@pytest.mark.parametrize("name,params,responses", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fmt", list(AnswerFormat), ids=lambda f: f.value)
def test_reward_equals_the_library_score(name, params, responses, fmt):
  config = ReasoningGymConfig(datasets=(ReasoningGymDataset(name, params=params),), seed=5,
                              size=1000, answer_format=fmt, format_reward=0.25)
  source = envs.ReasoningGymSource(config, eval_size=4)
  reward = envs.ReasoningGymReward(config)
  library = reasoning_gym.create_dataset(name, seed=5, size=1000, **params)
  scores = []
  for i in range(6):
    sample = source.sample(i)
    entry = library[int(sample.id.rsplit("-", 1)[1])]  # the same problem, built by the library
    assert sample.prompt.strip() == entry["question"].strip()
    assert sample.answer == (entry["answer"] or "")
    for text in responses(entry["answer"] or entry["metadata"].get("example_answer", "")):
      response = text if fmt is AnswerFormat.PLAIN else f"<think>hmm</think>\n<answer>{text}</answer>"
      expected = library.score_answer(text.strip().split("\n")[0] if fmt is AnswerFormat.PLAIN
                                      else text.strip(), entry)
      if fmt is AnswerFormat.PLAIN and not text.strip():
        expected = library.score_answer(None, entry)
      result = reward("", response, sample)
      assert result.info["score"] == pytest.approx(expected), (text, result.info)
      assert result.reward == pytest.approx(expected + 0.25 * bool(result.info["format_ok"]))
      assert result.info["correct"] == (expected == 1.0)
      scores.append(expected)
  assert 1.0 in scores and min(scores) < 1.0  # right answers and wrong ones are both exercised


def test_tagged_format_without_a_tag_scores_nothing():
  config = ReasoningGymConfig(datasets=(ReasoningGymDataset("chain_sum"),),
                              answer_format="tagged", format_reward=0.1)
  sample = envs.ReasoningGymSource(config, eval_size=1).sample(0)
  result = envs.ReasoningGymReward(config)("", sample.answer, sample)  # right number, no tag
  assert (result.reward, result.info["format_ok"]) == (0.0, False)
  result = envs.ReasoningGymReward(config)("", f"<answer>{sample.answer}</answer>", sample)
  assert result.reward == pytest.approx(1.1)


def test_reward_runs_in_a_spawned_process_pool():
  """The reward crosses a process boundary (spawn): it must pickle and rebuild its generators."""
  config = ReasoningGymConfig(datasets=(ReasoningGymDataset("basic_arithmetic", params=EASY),))
  sample = envs.ReasoningGymSource(config, eval_size=2).sample(3)
  with envs.make_process_pool(1) as pool:
    fn = envs.make_reward_fn(envs.RewardConfig(kind="reasoning_gym", reasoning_gym=config), pool)

    async def both():
      return await asyncio.wait_for(asyncio.gather(
          fn("", sample.answer, sample), fn("", str(int(sample.answer) + 1), sample)), 60)

    right, wrong = asyncio.run(both())
  assert (right.reward, wrong.reward) == (1.0, 0.0)


def _mix(seed=3):
  return ReasoningGymConfig(
      datasets=(ReasoningGymDataset("basic_arithmetic", weight=3, params=EASY),
                ReasoningGymDataset("leg_counting", weight=1)), seed=seed)


def test_stream_is_deterministic_weighted_and_never_yields_held_out_questions():
  a, b = envs.ReasoningGymSource(_mix(), eval_size=48), envs.ReasoningGymSource(_mix(), eval_size=48)
  stream = [a.sample(i) for i in range(2100)]  # crosses a chunk boundary (1024)
  assert stream == [b.sample(i) for i in range(2100)]
  other_seed = envs.ReasoningGymSource(_mix(seed=4), eval_size=48)
  assert stream != [other_seed.sample(i) for i in range(2100)]
  share = sum(s.task == "basic_arithmetic" for s in stream) / len(stream)
  assert share == pytest.approx(0.75, abs=0.03)
  held_out = a.eval_sets()
  assert sorted(held_out) == ["basic_arithmetic", "leg_counting"]
  for name, samples in held_out.items():
    prompts = [s.prompt for s in samples]
    assert len(prompts) == len(set(prompts)) == 48 and all(s.task == name for s in samples)
    # The easy arithmetic space has ~240 problems: a leak would show up in 2100 draws.
    assert not set(prompts) & {s.prompt for s in stream}
  assert all(a.reference(s) == s.answer for s in stream[:10])


def test_prompt_stream_resumes_exactly():
  src = PromptSource(envs.ReasoningGymSource(_mix(), eval_size=8))
  taken = [src.next() for _ in range(6)]
  src.give_back(2)
  state = src.state(in_flight=[4, 5])
  resumed = PromptSource(envs.ReasoningGymSource(_mix(), eval_size=8))
  resumed.restore(state)
  assert [resumed.next() for _ in range(4)] == [taken[2], taken[4], taken[5], (6, src.sample(6))]


def test_eval_set_larger_than_the_problem_space_fails_clearly():
  tiny = ReasoningGymConfig(datasets=(ReasoningGymDataset(
      "basic_arithmetic", params={**EASY, "operators": ("+",)}),))
  with pytest.raises(ValueError, match="only .* distinct questions"):
    envs.ReasoningGymSource(tiny, eval_size=500)


def test_step_metrics_per_dataset():
  def group(task, rewards, correct):
    g = Group(prompt_index=0, sample=envs.Sample("q", "a", task=task), prompt_ids=[1],
              n=len(rewards))
    for r, c in zip(rewards, correct):
      g.responses.append(Response("0", [3], [-1.0], [0], 0, "stop", reward=r,
                                  reward_info={"correct": c}))
    return g

  metrics = step_sample_metrics([group("a", [1.0, 0.5], [True, False]),
                                 group("b", [0.0, 0.0], [False, False]),
                                 group("a", [1.0, 1.0], [True, True])], trainer_version=0)
  assert metrics["reward_mean/a"] == pytest.approx(0.875)
  assert metrics["accuracy/a"] == pytest.approx(0.75)  # partial credit is not correct
  assert (metrics["reward_mean/b"], metrics["accuracy/b"]) == (0.0, 0.0)
  assert metrics["accuracy"] == pytest.approx(0.5)
