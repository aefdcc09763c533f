#!/usr/bin/env python3
"""Prepare the four-domain training data and the tokenizer of models/domain-moe.

Domains (one token stream each, documents separated by <|endoftext|>):
  prose  the three Gutenberg novels in ../shared/data/text/ (boilerplate stripped, the mis-decoded
         Windows-1252 punctuation U+0080-U+009F mapped to the characters it stands for);
  drama  Tiny Shakespeare;
  code   the CPython 3.11 standard library (one document per module);
  math   generated arithmetic and algebra exercises (seeded, see `math_document`).
WikiText-2 is evaluation-only and never read.

A held-out part of each domain is written as text (heldout/<domain>.txt, at most --heldout-chars
characters each, cut at a line end): the end of each novel, the last 10% of Tiny Shakespeare, whole modules
of the stdlib taken every k-th, and math documents from another seed. The tokenizer (byte-level BPE,
digits split one per token so numbers and passkeys copy digit by digit) is trained on the training
parts only; the training token ids are saved as uint16 .npy.

Output folder (--out):
  tokenizer.json, tokenizer_config.json, special_tokens_map.json
  train_<domain>.npy          uint16 token ids
  heldout/<domain>.txt        held-out text
  meta.json                   settings, sizes, token counts

  python scripts/prepare_domain_data.py --out /tmp/domain-data            # ~1 min on 2 CPU cores
  python scripts/prepare_domain_data.py --out /tmp/domain-smoke --smoke   # a few seconds
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_common import EOT, save_tokenizer, strip_gutenberg, train_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
NOVELS = ["text/pg1399.txt", "text/pg2554.txt", "text/pg2600.txt"]
DRAMA = "text/tinyshakespeare.txt"
CODE = "code/cpython311_stdlib.txt"
DOMAINS = ("prose", "drama", "code", "math")
MODULE_HEADER = "# ===== Lib/"


# --------------------------------------------------------------------------- #
# Pure text functions (unit-tested in tests/test_domain_data.py)
# --------------------------------------------------------------------------- #
def fix_cp1252(text: str) -> str:
    """Map C1 control characters U+0080-U+009F to what the byte meant in Windows-1252.

    The Gutenberg files were decoded as Latin-1, so a cp1252 right single quote (byte 0x92) became
    U+0092. The five code points cp1252 leaves undefined (0x81, 0x8D, 0x8F, 0x90, 0x9D) are kept.
    """
    out = []
    for ch in text:
        o = ord(ch)
        if 0x80 <= o <= 0x9F:
            try:
                ch = bytes([o]).decode("cp1252")
            except UnicodeDecodeError:
                pass
        out.append(ch)
    return "".join(out)


def split_tail(text: str, n_chars: int) -> tuple[str, str]:
    """(train, heldout): the held-out part is the last ~n_chars characters, starting at a line start."""
    if n_chars <= 0:
        return text, ""
    cut = max(0, len(text) - n_chars)
    newline = text.find("\n", cut)
    cut = newline + 1 if newline != -1 else len(text)
    return text[:cut], text[cut:]


def split_modules(text: str) -> list[str]:
    """The stdlib file as one string per module, each starting with its '# ===== Lib/...' header."""
    modules, current = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith(MODULE_HEADER) and current:
            modules.append("".join(current))
            current = []
        current.append(line)
    if current:
        modules.append("".join(current))
    return modules


def split_every_kth(docs: list[str], k: int, max_chars: int) -> tuple[list[str], list[str]]:
    """(train, heldout): documents i with i % k == k // 2 are held out until max_chars is reached."""
    if k < 2:
        raise ValueError(f"k must be >= 2, got {k}")
    train, held, held_chars = [], [], 0
    for i, doc in enumerate(docs):
        if i % k == k // 2 and held_chars + len(doc) <= max_chars:
            held.append(doc)
            held_chars += len(doc)
        else:
            train.append(doc)
    return train, held


def math_problem(rng: random.Random) -> str:
    """One exercise with its worked answer (all arithmetic exact)."""
    kind = rng.randrange(8)
    if kind == 0:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return f"{a} + {b} = {a + b}"
    if kind == 1:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return f"{a} - {b} = {a - b}"
    if kind == 2:
        a, b = rng.randrange(2, 100), rng.randrange(2, 100)
        return f"{a} * {b} = {a * b}"
    if kind == 3:
        b, q = rng.randrange(2, 50), rng.randrange(1, 100)
        return f"{b * q} / {b} = {q}"
    if kind == 4:
        a, b, c = rng.randrange(1, 20), rng.randrange(1, 20), rng.randrange(2, 12)
        return f"({a} + {b}) * {c} = {a + b} * {c} = {(a + b) * c}"
    if kind == 5:  # a x + b = c with an integer solution
        a, x, b = rng.randrange(2, 13), rng.randrange(-20, 21), rng.randrange(-50, 51)
        c = a * x + b
        sign, mag = ("+", b) if b >= 0 else ("-", -b)
        return f"Solve {a}x {sign} {mag} = {c}. {a}x = {c - b}, so x = {x}."
    if kind == 6:  # (x + p)(x + q)
        p, q = rng.randrange(-9, 10), rng.randrange(-9, 10)
        s, t = p + q, p * q

        def term(v: int, sym: str) -> str:
            if v == 0:
                return ""
            coef = "" if abs(v) == 1 and sym else str(abs(v))
            return f" {'+' if v > 0 else '-'} {coef}{sym}"

        def factor(v: int) -> str:
            return "(x)" if v == 0 else f"(x {'+' if v > 0 else '-'} {abs(v)})"

        return f"Expand {factor(p)}{factor(q)}: x^2{term(s, 'x')}{term(t, '')}"
    # kind 7: collect like terms
    a1, b1, a2, b2 = (rng.randrange(-9, 10) for _ in range(4))

    def lin(a: int, b: int) -> str:
        parts = []
        for v, sym in ((a, "a"), (b, "b")):
            if v == 0:
                continue
            mag = "" if abs(v) == 1 else str(abs(v))
            if not parts:
                parts.append(f"{'-' if v < 0 else ''}{mag}{sym}")
            else:
                parts.append(f" {'+' if v > 0 else '-'} {mag}{sym}")
        return "".join(parts) or "0"

    return f"Simplify ({lin(a1, b1)}) + ({lin(a2, b2)}): {lin(a1 + a2, b1 + b2)}"


def math_document(rng: random.Random, n_problems: int) -> str:
    return "Exercises.\n" + "\n".join(math_problem(rng) for _ in range(n_problems)) + "\n"


def math_corpus(seed: int, n_chars: int) -> list[str]:
    """Math documents (10-40 exercises each) totalling about n_chars characters."""
    rng = random.Random(seed)
    docs, total = [], 0
    while total < n_chars:
        doc = math_document(rng, rng.randrange(10, 41))
        docs.append(doc)
        total += len(doc)
    return docs


# --------------------------------------------------------------------------- #
# Corpus, tokenizer, output
# --------------------------------------------------------------------------- #
def load_domains(data_dir: Path, heldout_chars: int, math_chars: int, seed: int, smoke: bool) -> dict:
    """{domain: (train_docs, heldout_text)}."""
    limit = 200_000 if smoke else None  # smoke: first characters of each source only

    def read(rel: str) -> str:
        path = data_dir / rel
        if "wikitext" in path.name.lower():
            raise ValueError("wikitext is evaluation-only")
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        return text[:limit] if limit else text

    out = {}
    train, held = [], []
    per_novel = heldout_chars // len(NOVELS)
    for rel in NOVELS:
        t, h = split_tail(fix_cp1252(strip_gutenberg(read(rel))), per_novel)
        train.append(t)
        held.append(h)
    out["prose"] = (train, "".join(held))
    drama = read(DRAMA)
    t, h = split_tail(drama, min(heldout_chars, len(drama) // 10))  # Tiny Shakespeare is small: 10% at most
    out["drama"] = ([t], h)
    modules = split_modules(read(CODE))
    t, h = split_every_kth(modules, 20, heldout_chars)
    out["code"] = (t, "".join(h))
    held_math = "".join(math_corpus(seed + 1, heldout_chars))
    _, held_math = split_tail(held_math, heldout_chars)
    out["math"] = (math_corpus(seed, math_chars // (20 if smoke else 1)), held_math)
    return out


def encode_docs(tok, docs: list[str], eot_id: int):
    import numpy as np

    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.append(eot_id)
        ids.extend(enc.ids)
    arr = np.asarray(ids, dtype=np.uint16)
    assert int(arr.max()) < 65536
    return arr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--heldout-chars", type=int, default=195_000, help="held-out characters per domain")
    p.add_argument("--math-chars", type=int, default=6_000_000, help="generated math training characters")
    p.add_argument("--max-position-embeddings", type=int, default=4096, help="written as model_max_length")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smoke", action="store_true", help="a small slice of each source and a 1024-token vocabulary")
    args = p.parse_args(argv)
    if args.smoke:
        args.vocab_size = min(args.vocab_size, 1024)
        args.heldout_chars = min(args.heldout_chars, 20_000)
    return args


def main(argv: list[str] | None = None) -> dict:
    import numpy as np

    args = parse_args(argv)
    t0 = time.time()
    out = args.out
    (out / "heldout").mkdir(parents=True, exist_ok=True)
    print(f"[prepare] reading {args.data_dir}", flush=True)
    domains = load_domains(args.data_dir, args.heldout_chars, args.math_chars, args.seed, args.smoke)
    for name, (train, held) in domains.items():
        print(f"  {name}: {len(train)} docs, {sum(map(len, train)):,} train chars, {len(held):,} held-out chars")
        (out / "heldout" / f"{name}.txt").write_text(held, encoding="utf-8")

    print(f"[prepare] training byte-level BPE, vocabulary {args.vocab_size} ({time.time() - t0:.1f}s)", flush=True)
    all_train = [d for train, _ in domains.values() for d in train]
    tok = train_tokenizer(all_train, args.vocab_size, args.min_frequency, split_digits=True)
    save_tokenizer(tok, out, args.max_position_embeddings)
    eot_id = tok.token_to_id(EOT)

    meta = {"seed": args.seed, "vocab_size": tok.get_vocab_size(), "eot_id": eot_id, "smoke": args.smoke,
            "heldout_chars": args.heldout_chars, "math_chars": args.math_chars, "domains": {}}
    for name, (train, held) in domains.items():
        arr = encode_docs(tok, train, eot_id)
        np.save(out / f"train_{name}.npy", arr)
        held_tokens = len(tok.encode(held).ids)
        meta["domains"][name] = {"train_docs": len(train), "train_chars": sum(map(len, train)),
                                 "train_tokens": int(arr.size), "heldout_chars": len(held),
                                 "heldout_tokens": held_tokens}
        print(f"  {name}: {arr.size:,} train tokens, {held_tokens:,} held-out tokens", flush=True)
    meta["seconds"] = round(time.time() - t0, 1)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"[prepare] done in {meta['seconds']}s -> {out}", flush=True)
    return meta


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
