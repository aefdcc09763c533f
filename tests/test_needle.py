"""The passkey prompt: exact length, needle where asked, answers scored strictly."""
import random

import pytest

from moekv.eval.needle import NEEDLE_TEMPLATE, QUESTION, answer_is_correct, build_prompt, random_key


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character: an oracle that is easy to read back


def test_prompt_has_exact_length_and_needle_at_depth():
    filler = [ord("x")] * 1000
    for depth in (0.0, 0.25, 0.5, 1.0):
        p = build_prompt(encode, filler, 400, depth, "12345")
        assert len(p.ids) == 400
        text = "".join(map(chr, p.ids))
        assert text.endswith(QUESTION)
        needle = NEEDLE_TEMPLATE.format(key="12345")
        assert text.index(needle) == p.needle_position
        n_filler = 400 - len(needle) - len(QUESTION)
        assert p.needle_position == round(depth * n_filler)


def test_prompt_refuses_short_length_and_short_filler():
    with pytest.raises(ValueError, match="shorter than"):
        build_prompt(encode, [1] * 100, 10, 0.5, "12345")
    with pytest.raises(ValueError, match="filler has"):
        build_prompt(encode, [1] * 10, 400, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        build_prompt(encode, [1] * 1000, 400, 1.5, "12345")


def test_answer_scoring():
    assert answer_is_correct(" 12345.", "12345")
    assert answer_is_correct("12345", "12345")
    assert not answer_is_correct(" 123456", "12345")
    assert not answer_is_correct(" 1234", "12345")
    assert not answer_is_correct("the key is 12345", "12345")


def test_random_key_has_five_digits():
    rng = random.Random(0)
    keys = {random_key(rng) for _ in range(200)}
    assert all(len(k) == 5 and k[0] != "0" for k in keys) and len(keys) > 150
