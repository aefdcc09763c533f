"""The README's examples run as written, and every relative link in the user docs points at a file.

Convention: each fenced ```python or ```bash block of README.md is run on the CPU from the repository
root, unless the line right before its opening fence is `<!-- no-run: REASON -->` (a GPU, a network
server, a placeholder path, or the install itself). In a bash block that runs, every command must be
a `moekv ...` line (continuations with a trailing backslash are joined; `#` comments are dropped),
so that a block cannot be silently half-run.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md",
             REPO / "benchmarks" / "results" / "README.md"]
NO_RUN = re.compile(r"^<!--\s*no-run:(.*?)-->\s*$")
FENCE_OPEN = re.compile(r"^```(\w+)\s*$")
# the CLI's entry point, called as the installed `moekv` script calls it
CLI = "import sys; from moekv.cli import main; sys.exit(main())"


@dataclass
class Example:
    lang: str
    code: str
    line: int                # 1-based line of the opening fence
    no_run_reason: str | None


def extract_examples(markdown: str) -> list[Example]:
    """Fenced python/bash blocks with their no-run reason (None when the block runs)."""
    lines = markdown.splitlines()
    examples, i = [], 0
    while i < len(lines):
        marker = NO_RUN.match(lines[i].strip())
        if marker:
            reason = marker.group(1).strip()
            if not reason:
                raise ValueError(f"line {i + 1}: a no-run marker needs a reason")
            if i + 1 >= len(lines) or not FENCE_OPEN.match(lines[i + 1]):
                raise ValueError(f"line {i + 1}: a no-run marker must sit right before a code fence")
        fence = FENCE_OPEN.match(lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"line {i + 1}: code fence is never closed")
            prev = NO_RUN.match(lines[i - 1].strip()) if i > 0 else None
            if fence.group(1) in ("python", "bash"):
                examples.append(Example(fence.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1,
                                        prev.group(1).strip() if prev else None))
            i = end
        i += 1
    return examples


def bash_commands(code: str) -> list[list[str]]:
    """The argument lists of a runnable bash block's commands; every one must be `moekv ...`."""
    commands, pending = [], ""
    for raw in code.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        args = shlex.split(line, comments=True)
        if not args:
            continue
        if args[0] != "moekv":
            raise ValueError(f"a runnable bash block may hold only `moekv ...` commands, got {line.strip()!r}; "
                             "mark the block <!-- no-run: REASON --> if it cannot run here")
        commands.append(args[1:])
    return commands


def test_extractor_follows_the_convention():
    md = ("intro\n<!-- no-run: needs a GPU -->\n```bash\nmoekv serve --device cuda\n```\n"
          "```python\nprint(1)\n```\n```text\nnot code\n```\n"
          "```bash\nmoekv generate --prompt \"It was\" \\\n  --max-tokens 4   # a comment\n```\n")
    ex = extract_examples(md)
    assert [(e.lang, e.line, e.no_run_reason) for e in ex] == [("bash", 3, "needs a GPU"), ("python", 6, None),
                                                                  ("bash", 12, None)]
    assert bash_commands(ex[2].code) == [["generate", "--prompt", "It was", "--max-tokens", "4"]]
    with pytest.raises(ValueError, match="only `moekv"):
        bash_commands("pip install moekv\n")
    with pytest.raises(ValueError, match="needs a reason"):
        extract_examples("<!-- no-run: -->\n```bash\nmoekv info\n```\n")
    with pytest.raises(ValueError, match="right before a code fence"):
        extract_examples("<!-- no-run: later -->\n\n```bash\nmoekv info\n```\n")


README_EXAMPLES = extract_examples((REPO / "README.md").read_text())
RUNNABLE = [e for e in README_EXAMPLES if e.no_run_reason is None]


def test_readme_has_runnable_examples_of_both_kinds():
    assert {e.lang for e in RUNNABLE} == {"python", "bash"}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the examples are the CPU path, also on a GPU machine
    # one thread: the tiny model gains nothing from more, and on a shared 2-core machine torch's
    # default thread pool oversubscribes the cores (a 32-token generate: 0.5 s alone, 20 s contended)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("example", RUNNABLE, ids=[f"{e.lang}-line{e.line}" for e in RUNNABLE])
def test_readme_example_runs(example: Example):
    if example.lang == "python":
        r = _run([sys.executable, "-c", example.code])
        assert r.returncode == 0, f"README line {example.line}:\n{r.stderr[-3000:]}"
        assert r.stdout.strip(), f"README line {example.line}: the example printed nothing"
        return
    commands = bash_commands(example.code)
    assert commands, f"README line {example.line}: an empty bash block"
    for args in commands:
        r = _run([sys.executable, "-c", CLI, *args])
        assert r.returncode == 0, f"README line {example.line}: moekv {shlex.join(args)}\n{r.stderr[-3000:]}"
        assert r.stdout.strip(), f"README line {example.line}: moekv {shlex.join(args)} printed nothing"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # links inside code are not links
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_link_finder_sees_relative_links_only():
    assert LINK.findall("[a](docs/x.md) [b](https://e.org) [c](#top)") == ["docs/x.md", "https://e.org", "#top"]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def test_heading_anchors_follow_github():
    assert heading_anchors(REPO / "docs" / "performance.md") >= {"decode-attention",
                                                                 "what-bounds-the-compressed-formats"}


@pytest.mark.parametrize("doc", [p for p in DOC_FILES], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files(doc: Path):
    assert doc.exists(), f"{doc.relative_to(REPO)} is missing"
    broken = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        dest = doc.parent / path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest)):
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)} links to missing files or headings: {broken}"
