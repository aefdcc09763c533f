"""Tokenizer from tokenizer.json (the `tokenizers` library), chat template from tokenizer_config.json
or chat_template.jinja (rendered with jinja2), and an incremental detokenizer for streaming."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from moekv.models.loader import CheckpointError, read_json


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# the roles OpenAI's chat API takes for plain-text messages ('function', its deprecated form of 'tool',
# is left out); 'developer' is its name for 'system' on newer models, which vLLM and the openai client
# send too. Any other role would reach the chat template as an unknown speaker.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        """model_dir: a folder holding tokenizer.json (and tokenizer_config.json, a chat template),
        or the path of a tokenizers JSON file itself (its folder is searched for the rest)."""
        model_dir = Path(model_dir)
        if model_dir.is_file():
            path, model_dir = model_dir, model_dir.parent
        else:
            path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {model_dir} (moekv reads fast tokenizers only); "
                                    "give tokenizer= (--tokenizer) a folder or tokenizer.json file, or "
                                    "skip_tokenizer_init=True (--skip-tokenizer-init) for token-id prompts only")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a plain Exception on a malformed file
            raise CheckpointError(f"{path} could not be read as a tokenizers file: {e}") from e
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_json(cfg_path, "tokenizer_config.json") if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = self._find_chat_template(model_dir, cfg)
        self._path = path
        self._max_chars: float | None | bool = False  # not computed yet

    @staticmethod
    def _find_chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def tokenizers_object(self) -> HFTokenizer:
        """The underlying `tokenizers` Tokenizer (for libraries that build their own view of the vocabulary)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        check_text(text, "text")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja); send a plain prompt instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
        for i, m in enumerate(messages):
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role={m['role']!r} is not a chat role; accepted: "
                                 + ", ".join(repr(r) for r in CHAT_ROLES))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected these messages: {e}") from e

    @property
    def max_chars_per_token(self) -> float | None:
        """An upper bound on the characters of input text one token can stand for, so that a text
        of N characters needs at least N / bound tokens (a prompt that cannot fit is refused before
        it is tokenized). None when this tokenizer's pipeline gives no such bound: an unknown token
        that swallows a whole word, or a normalizer / pre-tokenizer that drops characters."""
        if self._max_chars is False:
            self._max_chars = _chars_per_token_bound(json.loads(self._path.read_text(encoding="utf-8")))
        return self._max_chars


class NoTokenizer:
    """The engine's tokenizer under skip_tokenizer_init (as vLLM's): nothing is loaded, so text cannot
    become tokens (a ValueError naming the option) and tokens become no text (outputs carry token
    ids and empty text)."""

    bos_token = eos_token = eos_token_id = chat_template = None
    MESSAGE = ("the engine was started with skip_tokenizer_init=True (no tokenizer): {what}; send token ids "
               "({{'prompt_token_ids': [...]}} in the Python API, a list of integers as the server's prompt)")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(self.MESSAGE.format(what="text prompts cannot be tokenized"))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        raise ValueError(self.MESSAGE.format(what="chat messages cannot be rendered and tokenized"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def id_to_token(self, token_id: int) -> str | None:
        return None

    max_chars_per_token = None  # no text is ever tokenized


def check_text(text: str, name: str) -> None:
    """ValueError naming `name` if `text` is not valid Unicode (a lone surrogate, which only an
    escaped JSON string or Python code can produce, and which no UTF-8 tokenizer can read)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character "
                         f"{e.start}; send UTF-8 text (a surrogate pair only as a complete pair)") from None


# normalizers that never shrink a text by more than this factor (NFC/NFKC compose at most 3 code
# points into one); a pre-tokenizer in _KEEPS_CHARS keeps every character (ByteLevel maps each byte
# to one, Metaspace each space to one); anything else may drop characters and gives no bound
_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 3, "NFKC": 3}
_KEEPS_CHARS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


def _normalizer_factor(node: dict | None) -> float | None:
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1
        for child in node.get("normalizers", []):
            f = _normalizer_factor(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a literal replaced by something at least as long keeps the length
        pattern = node.get("pattern", {})
        if "String" in pattern and len(node.get("content", "")) >= len(pattern["String"]):
            return 1
        return None
    return _SHRINK.get(kind)


def _keeps_chars(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_keeps_chars(child) for child in node.get("pretokenizers", []))
    if kind == "Split":
        return str(node.get("behavior", "")).lower() != "removed"
    return kind in _KEEPS_CHARS


def _chars_per_token_bound(spec: dict) -> float | None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")):
        return None  # WordPiece/Unigram/WordLevel, or a fused unknown token: one token, any length
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _keeps_chars(spec.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab") or {}
    added = [t.get("content", "") for t in spec.get("added_tokens") or []]
    longest = max([len(t) for t in vocab] + [len(t) for t in added] + [1])
    return float(factor * longest)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Decodes a short window of ids and emits what it adds to the text, holding back text that ends
    in an incomplete UTF-8 sequence (U+FFFD) until the next token completes it. The window starts
    with a few prompt tokens so that tokenizers that drop a leading space at the start of a
    decode (SentencePiece) still produce the right first word.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""
