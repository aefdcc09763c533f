"""The passkey-retrieval format shared by training data and `moekv eval retrieval`.

A five-digit passkey is stated once inside filler text at a chosen depth, and asked for at the end:

    <filler ...> NEEDLE <... filler> QUESTION  ->  the model should continue with the passkey.

Training sequences and evaluation prompts are built by the same function, so the model is asked
exactly what it learned to answer. Insertion works on token ids (not text), so a prompt's length in
tokens is exact; the needle and the question start and end with a newline, which keeps their
tokenization independent of the filler around them.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NEEDLE_TEMPLATE = "\nThe secret passkey is {key}. Remember it: {key} is the passkey.\n"
QUESTION = "\nWhat is the secret passkey? The secret passkey is "
KEY_DIGITS = 5


def random_key(rng: random.Random) -> str:
    """A passkey of KEY_DIGITS digits with no leading zero."""
    return str(rng.randrange(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))


@dataclass(frozen=True)
class NeedlePrompt:
    ids: list[int]  # the whole prompt: filler with the needle inside, then the question
    key: str  # the expected answer
    needle_position: int  # token index where the needle starts
    depth: float  # requested depth in [0, 1]


def build_prompt(
    encode: Callable[[str], list[int]],
    filler_ids: Sequence[int],
    length: int,
    depth: float,
    key: str,
) -> NeedlePrompt:
    """A prompt of exactly `length` tokens: filler_ids[:n] with the needle at `depth`, then the question.

    `encode` must not add special tokens. `filler_ids` must hold at least the filler this length needs.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = encode(NEEDLE_TEMPLATE.format(key=key))
    question = encode(QUESTION)
    n_filler = length - len(needle) - len(question)
    if n_filler < 0:
        raise ValueError(f"length {length} is shorter than the needle and question ({len(needle) + len(question)})")
    if len(filler_ids) < n_filler:
        raise ValueError(f"filler has {len(filler_ids)} tokens, {n_filler} needed for length {length}")
    at = round(depth * n_filler)
    filler = list(filler_ids[:n_filler])
    ids = filler[:at] + needle + filler[at:] + question
    return NeedlePrompt(ids=ids, key=key, needle_position=at, depth=depth)


def answer_is_correct(generated_text: str, key: str) -> bool:
    """The continuation must start with the key (leading spaces allowed) and not continue it with a digit."""
    text = generated_text.lstrip()
    return text.startswith(key) and not text[len(key) : len(key) + 1].isdigit()
