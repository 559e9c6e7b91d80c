"""Tokenizers: HF `tokenizer.json` via the `tokenizers` library, and a built-in character tokenizer.

The character tokenizer is itself an HF `tokenizers` object (a word-level model over single
characters), so the demo model ships a real `tokenizer.json` and every component loads tokenizers the
same way, whichever checkpoint it serves.
"""

from __future__ import annotations

import os
import string

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*/=()[]{}<>.,:;!?_#'\"\\\n"


class Tokenizer:
  """A thin typed wrapper over `tokenizers.Tokenizer` with the ids RL code needs."""

  def __init__(self, hf_tokenizer: HFTokenizer, *, eos_token: str | None = None,
               pad_token: str | None = None, bos_token: str | None = None):
    self._tok = hf_tokenizer
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
    self._tok.save(os.path.join(path, "tokenizer.json"))


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
  return Tokenizer(tok, eos_token=EOS, pad_token=PAD, bos_token=BOS)


def load_tokenizer(path: str) -> Tokenizer:
  """Loads `<path>/tokenizer.json` (a file or its directory); eos/pad from tokenizer_config.json."""
  file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
  if not os.path.exists(file):
    raise FileNotFoundError(f"No tokenizer.json at {path}.")
  hf_tok = HFTokenizer.from_file(file)
  config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
  names = {}
  if os.path.exists(config_file):
    import json
    with open(config_file) as f:
      cfg = json.load(f)
    for key in ("eos_token", "pad_token", "bos_token"):
      value = cfg.get(key)
      names[key] = value.get("content") if isinstance(value, dict) else value
  elif hf_tok.token_to_id(EOS) is not None:
    names = {"eos_token": EOS, "pad_token": PAD, "bos_token": BOS}
  return Tokenizer(hf_tok, **names)
