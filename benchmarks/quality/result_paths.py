"""Paths as the committed result JSONs record them: relative to the repository when inside it, so a
result reads the same from any checkout and does not name the machine it ran on.

    from result_paths import repo_path, repo_relative   # benchmarks/quality/ is on sys.path for its scripts
    record = {"predictor": repo_path(args.predictor), ...}
    out.write_text(json.dumps(repo_relative(record), indent=1))
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def repo_path(path: str | Path, repo: Path = REPO) -> str:
    """`path` relative to `repo` when it lies inside it (a relative `path` is taken from the current
    directory), else `path` as given."""
    full = Path(path).resolve()
    return str(full.relative_to(repo)) if full.is_relative_to(repo) else str(path)


def repo_relative(record, repo: Path = REPO):
    """A copy of a JSON-able record whose strings have every `<repo>/` prefix dropped, inside text too (a
    tool's captured stdout, a command line): the paths a subprocess echoes back become repo-relative."""
    if isinstance(record, str):
        return "." if record == str(repo) else record.replace(f"{repo}/", "")
    if isinstance(record, dict):
        return {k: repo_relative(v, repo) for k, v in record.items()}
    if isinstance(record, (list, tuple)):
        return [repo_relative(v, repo) for v in record]
    return record
