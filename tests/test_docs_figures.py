"""The figures the docs quote from result files match those files.

A doc names the source of what it quotes in an HTML comment (invisible when rendered) after the table
or paragraph that quotes it:

    <!-- figures: h200/domain_moe_kv_tables.json
    A = runs/0/formats
    "+0.10%" change A/fp8_e4m3/ppl/total/ppl A/bf16/ppl/total/ppl
    "97.5 / 92.5 / 92.5%" percent A/kivi2/retrieval/accuracy_by_length/{1024,2048,4096}
    -->

The first line names a JSON file under benchmarks/results/; a later line that is only a `.json` path
switches to another file. `NAME = PATH` defines an alias for a path's start. A figure line is the
string as the doc prints it, a kind and one or more paths. A path is keys separated by `/`; in a list,
an index or `[field=value,...]` (the one item whose fields match); `{a,b,...}` in one key expands the
path into several values, in order. Kinds: `value` (v), `percent` (100 v), `us` (1000 v: ms to us),
`ratio` (a / b), `share` (100 a / b), `change` (100 (a / b - 1)); the two-path kinds pair the
expansions of both paths (one value pairs with all).

Checked for every such comment in docs/*.md:
1. the quoted string is in the doc between the heading above the comment and the comment;
2. the quoted string's numbers, in order, equal the figure's values within the printed rounding (half
   a unit of each number's last digit; a leading + or - is a sign, a - between numbers a range);
3. every signed percentage (`+1.2%`) and decimal ratio (`2.48x`) in a table right above the comments
   is quoted by them as often as the table prints it, so a table figure without a source fails.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = sorted((ROOT / "docs").glob("*.md"))

COMMENT = re.compile(r"<!--\s*figures:\s*(.*?)-->", re.S)
FIGURE = re.compile(r'^"([^"]+)"\s+(\w+)\s+(.+)$')
ALIAS = re.compile(r"^([A-Za-z_]\w*)\s*=\s*(\S.*)$")
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
TABLE_FIGURE = re.compile(r"(?<![\w.])(?:[+-]\d+(?:\.\d+)?%|\d+\.\d+x(?!\w))")
KINDS = {"value": 1, "percent": 1, "us": 1, "ratio": 2, "share": 2, "change": 2}


@dataclass
class Figure:
    quoted: str
    kind: str
    paths: list[str]
    file: str
    line: int  # 1-based line of the doc the figure's comment line is on


@dataclass
class Block:
    start: int  # offsets of the comment in the doc text
    end: int
    figures: list[Figure]


def split_args(text: str) -> list[str]:
    """Whitespace-separated paths; spaces inside [...] selectors belong to the path."""
    out, cur, depth = [], "", 0
    for ch in text.strip():
        depth += ch == "["
        depth -= ch == "]"
        if ch.isspace() and depth == 0:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur else [])


def parse_blocks(doc: str) -> list[Block]:
    blocks = []
    for m in COMMENT.finditer(doc):
        first_line = doc.count("\n", 0, m.start()) + 1
        file, aliases, figures = None, {}, []
        for i, raw in enumerate(m.group(1).splitlines()):
            line = raw.strip()
            if not line:
                continue
            if line.endswith(".json") and " " not in line:
                file, aliases = line, {}
            elif (f := FIGURE.match(line)) is not None:
                assert file is not None, f"line {first_line + i}: a figure before any result file"
                paths = []
                for p in split_args(f.group(3)):
                    head, _, rest = p.partition("/")
                    paths.append(aliases[head] + ("/" + rest if rest else "") if head in aliases else p)
                figures.append(Figure(f.group(1), f.group(2), paths, file, first_line + i))
            elif (a := ALIAS.match(line)) is not None:
                aliases[a.group(1)] = a.group(2).strip()
            else:
                raise AssertionError(f"line {first_line + i}: not a file, alias or figure: {line!r}")
        blocks.append(Block(m.start(), m.end(), figures))
    return blocks


def select(node, segment: str):
    m = re.fullmatch(r"([^\[]*)(?:\[(.*)\])?", segment)
    name, selector = m.group(1), m.group(2)
    if name:
        node = node[int(name)] if isinstance(node, list) else node[name]
    if selector is not None:
        want = dict(part.split("=", 1) for part in selector.split(","))
        hits = [x for x in node if all(str(x.get(k)) == v for k, v in want.items())]
        assert len(hits) == 1, f"[{selector}] matches {len(hits)} items, not one"
        node = hits[0]
    return node


def resolve(data, path: str) -> list[float]:
    """The path's value, or its values when one of its keys is a {a,b,...} choice."""
    m = re.search(r"\{([^}]*)\}", path)
    if m is not None:
        return [v for choice in m.group(1).split(",")
                for v in resolve(data, path[:m.start()] + choice + path[m.end():])]
    node = data
    for segment in path.split("/"):
        node = select(node, segment)
    assert isinstance(node, (int, float)) and not isinstance(node, bool), f"{path} is {node!r}, not a number"
    return [float(node)]


def values(fig: Figure, results: Path) -> list[float]:
    data = json.loads((results / fig.file).read_text())
    assert fig.kind in KINDS, f"unknown kind {fig.kind!r}"
    if KINDS[fig.kind] == 1:
        scale = {"value": 1.0, "percent": 100.0, "us": 1000.0}[fig.kind]
        return [scale * v for p in fig.paths for v in resolve(data, p)]
    assert len(fig.paths) == 2, f"{fig.kind} takes two paths, got {fig.paths}"
    a, b = (resolve(data, p) for p in fig.paths)
    n = max(len(a), len(b))
    assert len(a) in (1, n) and len(b) in (1, n), f"{fig.paths}: {len(a)} values against {len(b)}"
    pairs = zip(a * n if len(a) == 1 else a, b * n if len(b) == 1 else b)
    op = {"ratio": lambda x, y: x / y, "share": lambda x, y: 100 * x / y,
          "change": lambda x, y: 100 * (x / y - 1)}[fig.kind]
    return [op(x, y) for x, y in pairs]


def printed_numbers(text: str) -> list[tuple[float, int]]:
    """(value, decimals) of each number in `text`; a + or - right after a digit is a range's dash."""
    out = []
    for m in NUMBER.finditer(text):
        s = m.group(0)
        if s[0] in "+-" and m.start() > 0 and text[m.start() - 1].isalnum():
            s = s[1:]
        digits = s.lstrip("+-").partition(".")[2]
        out.append((float(s), len(digits)))
    return out


def section_before(doc: str, offset: int) -> str:
    """The doc's text from the heading above `offset` to it, without the figures comments."""
    start = max(doc.rfind("\n#", 0, offset), 0)
    return COMMENT.sub("", doc[start:offset])


def table_above(doc: str, blocks: list[Block], index: int) -> tuple[str, list[Block]]:
    """The table right above block `index` (with comments and blank lines between skipped), and every
    figures block that follows that table."""
    pos, group = blocks[index].start, [blocks[index]]
    for j in range(index - 1, -1, -1):
        if doc[blocks[j].end:pos].strip() == "":
            pos, group = blocks[j].start, [blocks[j]] + group
        else:
            break
    lines = doc[:pos].rstrip("\n").split("\n")
    table = []
    while lines and lines[-1].startswith("|"):
        table.insert(0, lines.pop())
    for j in range(index + 1, len(blocks)):
        if doc[group[-1].end:blocks[j].start].strip() != "":
            break
        group.append(blocks[j])
    return "\n".join(table), group


def check_doc(doc: str, results: Path = RESULTS) -> list[str]:
    """Every mismatch between `doc` and the result files its figures comments name."""
    errors = []
    blocks = parse_blocks(doc)
    for block in blocks:
        section = section_before(doc, block.start)
        for fig in block.figures:
            where = f"line {fig.line} ({fig.file})"
            if fig.quoted not in section:
                errors.append(f"{where}: {fig.quoted!r} is not in the text above the comment")
            try:
                got = values(fig, results)
            except (AssertionError, KeyError, IndexError, ValueError, FileNotFoundError) as e:
                errors.append(f"{where}: {fig.quoted!r}: {type(e).__name__}: {e}")
                continue
            printed = printed_numbers(fig.quoted)
            if len(printed) != len(got):
                errors.append(f"{where}: {fig.quoted!r} prints {len(printed)} numbers, the paths give {len(got)}")
                continue
            for (shown, decimals), value in zip(printed, got):
                if not math.isclose(shown, value, abs_tol=0.5 * 10 ** -decimals + 1e-9):
                    errors.append(f"{where}: {fig.quoted!r} prints {shown:g}, the result file gives {value:.6g}")
    for i in range(len(blocks)):
        table, group = table_above(doc, blocks, i)
        if not table or group[0] is not blocks[i]:
            continue
        quoted = [t for b in group for f in b.figures for t in TABLE_FIGURE.findall(f.quoted)]
        printed = TABLE_FIGURE.findall(table)
        for token in sorted(set(printed)):
            shown, sourced = printed.count(token), quoted.count(token)
            if sourced < shown:
                line = doc.count("\n", 0, blocks[i].start) + 1
                errors.append(f"table above line {line}: {token} is printed {shown} times, quoted {sourced}")
    return errors


def docs_with_figures() -> list[Path]:
    return [p for p in DOCS if COMMENT.search(p.read_text())]


def test_kv_formats_names_the_source_of_its_figures():
    doc = (ROOT / "docs" / "kv-formats.md").read_text()
    files = {f.file for b in parse_blocks(doc) for f in b.figures}
    assert {"h200/domain_moe_kv_tables.json", "h200/decode_attention_gluon.json",
            "h200/decode_attention.json"} <= files


@pytest.mark.parametrize("path", docs_with_figures(), ids=lambda p: p.name)
def test_quoted_figures_match_their_result_files(path: Path):
    errors = check_doc(path.read_text())
    assert not errors, "\n".join(errors)


SAMPLE = """## A table

| format | change | speed |
|---|---|---|
| a | +2.4% | 1.50x |

<!-- figures: sample.json
R = runs/0
"+2.4%" change R/rows[name=a]/ppl R/rows[name=base]/ppl
"1.50x" ratio R/base_ms R/rows[name=a]/ms
-->
"""


@pytest.fixture
def sample_results(tmp_path: Path) -> Path:
    rows = [{"name": "base", "ppl": 10.0, "ms": 3.0}, {"name": "a", "ppl": 10.24, "ms": 2.0}]
    runs = [{"base_ms": 3.0, "rows": rows}]
    (tmp_path / "sample.json").write_text(json.dumps({"runs": runs}))
    return tmp_path


def test_the_check_passes_a_doc_that_matches(sample_results: Path):
    assert check_doc(SAMPLE, sample_results) == []


def test_the_check_fails_a_figure_that_drifted(sample_results: Path):
    doc = SAMPLE.replace("+2.4%", "+2.6%")
    assert any("prints 2.6" in e for e in check_doc(doc, sample_results))


def test_the_check_fails_a_table_figure_without_a_source(sample_results: Path):
    doc = SAMPLE.replace("| a | +2.4% | 1.50x |", "| a | +2.4% | 1.50x |\n| b | -0.3% | 1.50x |")
    errors = check_doc(doc, sample_results)
    assert any("-0.3%" in e for e in errors) and any("1.50x is printed 2 times" in e for e in errors)


def test_the_check_fails_a_quote_the_doc_no_longer_prints(sample_results: Path):
    doc = SAMPLE.replace("| a | +2.4% |", "| a | +2.40% |").replace('"+2.4%"', '"+2.5%"')
    assert any("not in the text above" in e for e in check_doc(doc, sample_results))


def test_ranges_and_signs_are_read_as_printed():
    assert printed_numbers("92.5-97.5%") == [(92.5, 1), (97.5, 1)]
    assert printed_numbers("-0.13% and +0.79%") == [(-0.13, 2), (0.79, 2)]
    assert printed_numbers("4.66 (4.91); 3.09 read") == [(4.66, 2), (4.91, 2), (3.09, 2)]
