"""`moekv generate`: generate text from a prompt, streaming tokens to the terminal."""
from __future__ import annotations

import argparse
import sys
import time

from moekv.cli.engine_args import add_engine_args, engine_config_from

# the sampling flags that default to the checkpoint's generation_config.json, and their values when
# it names none of them (greedy, no penalty)
SAMPLING_FALLBACKS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}


def cmd_generate(args: argparse.Namespace) -> int:
    from moekv.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from(args))
    try:
        return _generate(engine, args)
    finally:
        engine.shutdown()  # the worker ranks of --tensor-parallel-size > 1


def _generate(engine, args: argparse.Namespace) -> int:
    from moekv.sampling_params import SamplingParams

    # a flag given wins, then the checkpoint's generation_config.json, then greedy without penalties
    defaults = engine.generation_defaults()
    sampling = {name: getattr(args, name) if getattr(args, name) is not None else defaults.get(name, fallback)
                for name, fallback in SAMPLING_FALLBACKS.items()}
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.request_seed, stop=args.stop or None,
                            ignore_eos=args.ignore_eos, **sampling)
    prompt = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]), add_special_tokens=False)}
    _warn_if_capped(engine, prompt, args.max_tokens)
    engine.add_request("cli", prompt, params, output_kind="delta")  # printed as it comes; the final output has all
    if not args.chat and not args.quiet:
        print(args.prompt, end="", flush=True)
    start = time.perf_counter()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
            print(out.delta_text, end="", flush=True)
            final = out
    elapsed = time.perf_counter() - start
    print()
    if final is not None and not args.quiet:
        n = len(final.outputs[0].token_ids)
        print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, "
              f"finish_reason={final.outputs[0].finish_reason}]",
              file=sys.stderr)
    return 0


def _warn_if_capped(engine, prompt, max_tokens: int) -> None:
    """A warning on stderr when the prompt and --max-tokens do not fit the context: the engine generates
    only up to max_model_len (where the server answers 400), and the user should know it."""
    _, ids = engine.tokenize_prompt(prompt)
    room = engine.max_model_len - len(ids)
    if 0 < room < max_tokens:
        print(f"moekv generate: warning: --max-tokens {max_tokens} does not fit the model's context "
              f"(max_model_len={engine.max_model_len}, the prompt takes {len(ids)} tokens): generating at most "
              f"{room} tokens", file=sys.stderr)


def unescape(value: str) -> str:
    """A flag's value with its backslash escapes decoded, as a shell user writes them: "\\n\\n" is two
    newlines, "\\t" a tab, "\\\\" one backslash; other characters (non-ASCII too) stay as they are."""
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: bad backslash escape ({e.reason}); write \\\\ for a "
                                         "backslash") from None


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Register `generate` on the `moekv` sub-command parsers."""
    gen = subparsers.add_parser("generate", help="generate text from a prompt, streaming tokens to the terminal")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    from_model = "(default: the checkpoint's generation_config.json, else {})"
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy " + from_model.format(0.0))
    gen.add_argument("--top-p", type=float, default=None, help=from_model.format(1.0))
    gen.add_argument("--top-k", type=int, default=None, help="-1 = off " + from_model.format(-1))
    gen.add_argument("--repetition-penalty", type=float, default=None, help=from_model.format(1.0))
    gen.add_argument("--request-seed", type=int, default=None,
                     help="this request's own sampling seed (--seed is the engine's, as in every command)")
    gen.add_argument("--stop", action="append", type=unescape,
                     help="stop string (repeatable); backslash escapes are decoded: \"\\n\\n\" is a blank line")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--quiet", action="store_true", help="print only the generated text")
    # one prompt runs, so the KV pool needs one sequence's pages (on the CPU the pool is zero-filled at
    # start: 1 GiB for 64 sequences of a 4k model against 32 MiB for one)
    gen.set_defaults(func=cmd_generate, max_num_seqs=1)

    return gen
