"""`moekv` command line: generate | serve | bench | eval (ppl, routing, retrieval) | calibrate | cluster | info.

One module per command group registers its parser; the engine flags they share come from
cli/engine_args.py (generated from EngineConfig's fields).
"""
from __future__ import annotations

import argparse
import sys

from moekv import __version__
from moekv.cli.bench import add_bench_parser
from moekv.cli.calibrate import add_calibrate_parser
from moekv.cli.cluster import add_cluster_parser
from moekv.cli.engine_args import add_engine_args, engine_config_from
from moekv.cli.eval import add_eval_parser
from moekv.cli.experts import add_calibrate_experts_parser
from moekv.cli.generate import add_generate_parser
from moekv.cli.info import add_info_parser
from moekv.cli.serve import add_serve_parser

__all__ = ["add_engine_args", "build_parser", "engine_config_from", "main"]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every optional flag's help ends with its default, "(default: X)", unless the help names it already
    (a default decided at run time: "(default: the model's limit)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if action.required or "(default" in help or "%(default)" in help:
            return help
        return super()._get_help_string(action)


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    """DefaultsHelpFormatter for the parser and every sub-command's parser below it."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekv", description="Inference engine for Mixture-of-Experts models")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_eval_parser(sub)
    add_cluster_parser(sub)
    add_info_parser(sub)
    add_calibrate_parser(sub)
    add_calibrate_experts_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    _use_formatter(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"moekv {args.command}: error: {e}", file=sys.stderr)
        return 2
