"""`moekv` command line: generate | serve | bench | eval (ppl, routing, retrieval) | calibrate | cluster | info.

One module per command group registers its parser; the engine flags they share come from
cli/engine_args.py (generated from EngineConfig's fields).
"""
from __future__ import annotations

import argparse
import sys

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekv", description="Inference engine for Mixture-of-Experts models")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_eval_parser(sub)
    add_cluster_parser(sub)
    add_info_parser(sub)
    add_calibrate_parser(sub)
    add_calibrate_experts_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"moekv {args.command}: error: {e}", file=sys.stderr)
        return 2
