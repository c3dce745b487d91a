"""Citations resolve: every ``[Key]`` the code's prose cites is defined in docs/references.md, and no
docstring, comment or doc cites a file a user of the project does not have (papers/NNN, docs/design.md)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("bench", "defenses", "attacks", "models", "examples", "tests")
DOCS = ("README.md", "CONTRIBUTING.md", "docs")
# a citation: [Key] not inside code notation (list[Task], [N, C, H, W]) and not a markdown link [text](url)
CITE_RE = re.compile(r"(?<![\w\]\[.`'\"])\[([A-Z][A-Za-z0-9]+(?:-[A-Za-z0-9]+)*)\](?![\w(\[])")
NOT_CITATIONS = {"PAD", "UNK", "BOS", "EOS", "CLS", "SEP", "MASK"}  # tokenizer special tokens in prose
UNRESOLVABLE_RE = re.compile(r"(?<![\w/])papers/\d{3}|(?<![\w/.])DESIGN\.md")


def defined_keys() -> dict[str, int]:
    """Keys defined in docs/references.md (first column of its tables), with how often each is defined."""
    counts: dict[str, int] = {}
    for line in (ROOT / "docs" / "references.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*\[([^\]]+)\]\s*\|", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the comments, docstrings and ``paper = "..."`` class attributes of a module."""
    src = path.read_text(encoding="utf-8")
    starts = set()
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)
        ):
            starts.add((node.body[0].value.lineno, node.body[0].value.col_offset))
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "paper" for t in stmt.targets
                ):
                    starts |= {(c.lineno, c.col_offset) for c in ast.walk(stmt.value) if isinstance(c, ast.Constant)}
    return [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in starts)
    ]


def prose() -> list[tuple[str, int, str]]:
    """(file, line, text) of all prose: Python comments / docstrings / paper attributes, and the docs."""
    out = []
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")) if (ROOT / d).is_dir() else []:
            rel = str(p.relative_to(ROOT))
            if rel == "tests/test_docs.py":  # this file spells the patterns out
                continue
            out += [(rel, line, text) for line, text in python_prose(p)]
    for name in DOCS:
        p = ROOT / name
        for f in [p] if p.is_file() else sorted(p.rglob("*.md")) if p.is_dir() else []:
            out += [
                (str(f.relative_to(ROOT)), i, line)
                for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
            ]
    return out


def test_references_define_each_key_once_with_a_full_citation():
    keys = defined_keys()
    assert {
        "FedRand",
        "DP-FedLoRA",
        "FLRSP",
        "SMP-LoRA",
        "APRIL",
        "InvGrad",
        "DLG",
        "VL-MIA",
        "MinK",
        "GSA",
        "LiRA",
        "RMIA",
        "FedAvg",
        "FedPer",
        "FedPara",
        "DP-SGD",
        "RDP",
        "LoRA",
        "FedProx",
        "SCAFFOLD",
        "FedOpt",
    } <= set(keys)
    assert [k for k, n in keys.items() if n > 1] == []
    text = (ROOT / "docs" / "references.md").read_text(encoding="utf-8")
    for key in keys:
        row = next(line for line in text.splitlines() if line.startswith(f"| [{key}] |"))
        assert re.search(r"(19|20)\d\d", row) and "*" in row, f"[{key}] needs authors, an italic title and a year"


def test_every_cited_key_resolves_in_references():
    keys = set(defined_keys())
    unresolved = [
        f"{f}:{line}: [{m.group(1)}]"
        for f, line, text in prose()
        for m in CITE_RE.finditer(text)
        if m.group(1) not in keys | NOT_CITATIONS
    ]
    assert unresolved == [], "cited keys missing from docs/references.md:\n" + "\n".join(unresolved)


def test_no_citation_of_files_users_do_not_have():
    stale = [f"{f}:{line}: {m.group(0)}" for f, line, text in prose() for m in UNRESOLVABLE_RE.finditer(text)]
    assert stale == [], (
        "cite by key ([FedRand] Eq. 11) or docs/design.md instead of:\n"
        + "\n".join(stale[:40])
        + (f"\n... and {len(stale) - 40} more" if len(stale) > 40 else "")
    )


@pytest.mark.parametrize("doc", ["design.md", "architecture.md", "references.md"])
def test_docs_exist_and_link_to_existing_project_files(doc):
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    missing = [
        p
        for p in re.findall(r"`((?:bench|defenses|attacks|models|tests|docs)/[\w/.]+\.(?:py|md))`", text)
        if not (ROOT / p).exists()
    ]
    assert missing == [], f"docs/{doc} names files that do not exist: {missing}"
