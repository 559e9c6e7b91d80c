"""The OpenAI-compatible API, driven by the real `openai` Python client against a real server.

Completions and chat completions, streaming and not, `n`, `stop`, `seed`, logprobs/top_logprobs,
tools through the chat template, the RL extra fields (token ids, prompt ids, weight version,
behaviour log-probs) checked against the native `/generate` answer for the same prompt, and chat
prompts checked token for token against transformers' `apply_chat_template` on the same directory.
"""

import json
import urllib.request

import openai
import pytest
import transformers

from flashrl_jax.model import CHAT_TEMPLATE
from flashrl_jax.rollout import ChatTemplate, parse_tool_calls
from tests.api_servers import start_servers, write_hf_checkpoint

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
TOOL_TURNS = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("openai_model"))
  write_hf_checkpoint(path)
  with start_servers(path, 1, "--served_model_name=tiny",
                     log_dir=str(tmp_path_factory.mktemp("openai_logs"))) as servers:
    url = servers.urls[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield url, client, transformers.AutoTokenizer.from_pretrained(path)


def native(url, **body):
  req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode())
  with urllib.request.urlopen(req, timeout=120) as resp:
    return json.loads(resp.read())


def test_models_and_completions(served):
  url, client, _ = served
  assert [m.id for m in client.models.list().data] == ["tiny"]
  ref = native(url, text="2+2=", return_logprob=True, return_prompt_token_ids=True,
               sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
  out = client.completions.create(model="tiny", prompt="2+2=", max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
  (choice,) = out.choices
  assert choice.text == ref["text"] and choice.finish_reason == "length"
  assert choice.token_ids == ref["output_ids"]
  assert choice.prompt_token_ids == ref["prompt_token_ids"]
  want = [e[0] for e in ref["meta_info"]["output_token_logprobs"]]
  assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
  assert all(len(row) <= 2 for row in choice.logprobs.top_logprobs)
  assert choice.meta_info["weight_version"] == out.metadata["weight_version"] == "default"
  assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == 4
  # n samples with a seed: distinct choices, reproducible as a whole.
  first = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=5, n=3, seed=7,
                                    extra_body={"ignore_eos": True})
  again = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=5, n=3, seed=7,
                                    extra_body={"ignore_eos": True})
  assert [c.index for c in first.choices] == list(range(6))
  assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
  assert len({tuple(c.token_ids) for c in first.choices[:3]}) > 1
  # Streaming gives the same text, in deltas, and usage on request.
  chunks = list(client.completions.create(model="tiny", prompt="2+2=", max_tokens=6, temperature=0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
  assert chunks[-1].usage.completion_tokens == 6


def test_stop_strings_trim_like_native(served):
  url, client, _ = served
  ref = native(url, text="xy", sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                "ignore_eos": True})
  stop = ref["text"][3]
  out = client.completions.create(model="tiny", prompt="xy", max_tokens=10, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
  assert out.choices[0].finish_reason == "stop" and out.choices[0].matched_stop == stop
  assert out.choices[0].text == ref["text"][:ref["text"].index(stop)]


def test_chat_prompt_is_transformers_apply_chat_template(served):
  url, client, hf_tok = served
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
  (choice,) = out.choices
  want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
  assert choice.prompt_token_ids == list(want)
  ref = native(url, input_ids=list(want), return_logprob=True,
               sampling_params={"max_new_tokens": 5, "temperature": 0})
  assert choice.token_ids == ref["output_ids"] and choice.message.content == ref["text"]
  assert choice.message.role == "assistant"
  assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
      [e[0] for e in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
  assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-5 for c in choice.logprobs.content)
  # Tools and tool turns go through the template exactly as transformers renders them.
  out = client.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=TOOLS,
                                       max_tokens=3, temperature=0)
  want = hf_tok.apply_chat_template(TOOL_TURNS, tools=TOOLS, add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
  assert out.choices[0].prompt_token_ids == list(want)


def test_chat_streaming_matches_non_streaming(served):
  _, client, _ = served
  messages = [{"role": "user", "content": "count"}]
  full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
  chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
      full.choices[0].message.content
  assert chunks[-1].choices[0].finish_reason == "length"
  streamed = sum((getattr(c.choices[0], "token_ids", None) or [] for c in chunks), [])
  assert streamed == full.choices[0].token_ids


@pytest.mark.parametrize("kwargs,field", [
    ({"logit_bias": {"5": 2.0}}, "logit_bias"), ({"n": 0}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_unsupported_values_are_400_naming_the_field(served, kwargs, field):
  _, client, _ = served
  with pytest.raises(openai.BadRequestError, match=field):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=2, **kwargs)


def test_template_renders_like_transformers_and_tool_calls_parse():
  """Our Jinja renderer against transformers' on templates using its features (null keys dropped:
  the tool-call turn's `content: null` renders as absent)."""
  rich = ("{% for m in messages %}{% if loop.first and m.role != 'system' %}"
          "{{ raise_exception('system first') }}{% endif %}"
          "{% if m.role == 'assistant' %}{% generation %}"
          "{{ m.content | default('absent') | tojson(indent=1) }}"
          "{% endgeneration %}{% else %}{{ bos_token }}{{ m.content }}{% endif %}"
          "{% if loop.index > 3 %}{% break %}{% endif %}\n{% endfor %}")
  convs = [[{"role": "system", "content": "s"}, {"role": "user", "content": "é \"q\""},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "late"}], TOOL_TURNS]
  from flashrl_jax.model import char_tokenizer
  import tempfile
  path = tempfile.mkdtemp()
  char_tokenizer().save(path)
  hf_tok = transformers.AutoTokenizer.from_pretrained(path)
  for source in (CHAT_TEMPLATE, rich):
    ours = ChatTemplate(source, {"bos_token": "<bos>", "eos_token": "<eos>"})
    for conv in convs:
      for tools in (None, TOOLS):
        kw = dict(tools=tools, add_generation_prompt=True)
        assert ours.render(conv, **kw) == hf_tok.apply_chat_template(
            conv, chat_template=source, tokenize=False, **kw)
  with pytest.raises(ValueError, match="system first"):
    ChatTemplate(rich).render([{"role": "user", "content": "x"}])
  content, calls = parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1}}'
                                    '</tool_call><tool_call>not json</tool_call>')
  assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
      ("add", {"a": 1})]
  assert content == "ok <tool_call>not json</tool_call>"
  assert parse_tool_calls("plain") == ("plain", [])
