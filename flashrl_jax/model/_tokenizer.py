"""Tokenizers: HF `tokenizer.json` via the `tokenizers` library, and a built-in character tokenizer.

The character tokenizer is itself an HF `tokenizers` object (a word-level model over single
characters), so the demo model ships a real `tokenizer.json` and every component loads tokenizers the
same way, whichever checkpoint it serves. It is saved with a `tokenizer_config.json` that carries its
special tokens and a chat template (`CHAT_TEMPLATE`), so `transformers.AutoTokenizer` loads the
directory and the server's OpenAI chat API renders conversations for the demo model.
"""

from __future__ import annotations

import json
import os
import string

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*/=()[]{}<>.,:;!?_#'\"\\\n"

# The character tokenizer's chat template (Jinja2, rendered as transformers renders templates). Every
# character it emits is in the alphabet; a turn ends with the `<eos>` special token, so a generated
# assistant turn stops there. Tools are listed up front as JSON; a tool call is
# `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (the Hermes convention).
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<tools>' + (tools | tojson) + '</tools>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<' + message['role'] + '>' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '" + EOS + "\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<assistant>' }}{%- endif %}")


class Tokenizer:
  """A thin typed wrapper over `tokenizers.Tokenizer` with the ids RL code needs."""

  def __init__(self, hf_tokenizer: HFTokenizer, *, eos_token: str | None = None,
               pad_token: str | None = None, bos_token: str | None = None,
               chat_template: str | None = None):
    self._tok = hf_tokenizer
    self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
    self.chat_template = chat_template
    self.eos_token_id = self._id(eos_token)
    self.pad_token_id = self._id(pad_token)
    self.bos_token_id = self._id(bos_token)

  def _id(self, token: str | None) -> int | None:
    return None if token is None else self._tok.token_to_id(token)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def save(self, path: str) -> None:
    """Writes `tokenizer.json` and a `tokenizer_config.json` transformers can load."""
    self._tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
              "pad_token": self.pad_token, "bos_token": self.bos_token,
              "unk_token": UNK if self._tok.token_to_id(UNK) is not None else None,
              "clean_up_tokenization_spaces": False}
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=1)


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Tokenizer:
  """One token per character of `alphabet`; ids 0-3 are `<pad> <bos> <eos> <unk>`."""
  specials = [PAD, BOS, EOS, UNK]
  vocab = {tok: i for i, tok in enumerate(specials)}
  for ch in alphabet:
    vocab.setdefault(ch, len(vocab))
  tok = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(specials)
  return Tokenizer(tok, eos_token=EOS, pad_token=PAD, bos_token=BOS, chat_template=CHAT_TEMPLATE)


def load_tokenizer(path: str) -> Tokenizer:
  """Loads `<path>/tokenizer.json` (a file or its directory); eos/pad from tokenizer_config.json."""
  file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
  if not os.path.exists(file):
    raise FileNotFoundError(f"No tokenizer.json at {path}.")
  hf_tok = HFTokenizer.from_file(file)
  config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
  names = {}
  if os.path.exists(config_file):
    with open(config_file) as f:
      cfg = json.load(f)
    for key in ("eos_token", "pad_token", "bos_token"):
      value = cfg.get(key)
      names[key] = value.get("content") if isinstance(value, dict) else value
    template = cfg.get("chat_template")
    if isinstance(template, list):  # transformers' named-template form: take the default one
      template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    names["chat_template"] = template if isinstance(template, str) else None
  elif hf_tok.token_to_id(EOS) is not None:
    names = {"eos_token": EOS, "pad_token": PAD, "bos_token": BOS}
  return Tokenizer(hf_tok, **names)
