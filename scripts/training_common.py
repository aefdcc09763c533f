"""Gutenberg stripping, the byte-level BPE, its files and chat template, for the training data.

Imported by scripts/prepare_domain_data.py (run as a script, so this folder is on sys.path).
"""
from __future__ import annotations

import json
from pathlib import Path

EOT = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg licence boilerplate around the '*** START/END OF' markers."""
    lines = text.split("\n")
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        if line.lstrip().startswith("*** START OF"):
            start = i + 1
            break
    for i in range(len(lines) - 1, start - 1, -1):
        if lines[i].lstrip().startswith("*** END OF"):
            end = i
            break
    return "\n".join(lines[start:end]).strip("\n") + "\n"


def train_tokenizer(texts: list[str], vocab_size: int, min_frequency: int, split_digits: bool = False):
    """A byte-level BPE trained on `texts` (paragraph pieces); split_digits: every digit its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Byte-level: every byte is in the alphabet, so nothing is ever <unk>.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Feed paragraphs so the trainer can count words in parallel.
    pieces = [p for t in texts for p in t.split("\n\n") if p]
    tok.train_from_iterator(pieces, trainer=trainer, length=len(pieces))
    return tok



def save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json + config files by hand so the layout is the same on every transformers version."""
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
