"""The repository stands alone: every file its docs and committed results cite exists in it.

Scans README.md, docs/, benchmarks/results/, the services' READMEs and the bundled model's card for
references to repository files: paths under a top-level folder of the repository (`docs/method.md`,
`services/rollout/consumers.py`), top-level document names (`README.md`, `METHOD.md`), module paths
under solrl/ (`algo/nft.py`) and, in benchmarks/results, sibling files (`rollout.md`). Each must exist,
or be git-ignored (a file the user creates or a run writes, e.g. the b200 overlay's token file). The dated
results in benchmarks/results cite test files as the flat tests/ of their day laid them out (`tests/test_loop.py`):
such a path resolves to the one test file of that name in a folder of tests/ (`tests/engine/test_loop.py`).
Run outputs (`metrics.jsonl`) and other projects' files (`flow_grpo/ocr.py`) are not repository paths
and are not looked up.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")), *sorted((ROOT / "benchmarks" / "results").glob("*.md")),
        *sorted((ROOT / "services").glob("*/README.md")), ROOT / "solrl" / "shapes" / "weights" / "README.md"]
EXT = r"(?:md|py|json|jsonl|ya?ml|png|proto|toml|txt|safetensors)"
REF = re.compile(rf"(?<![\w/.:-])((?:[\w.-]+/)*[\w.-]+\.{EXT})(?![\w/])")
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} - {"solrl.egg-info", "runs"}
MODULES = {p.name for p in (ROOT / "solrl").iterdir() if p.is_dir()}


def references(path: Path) -> list[str]:
    """The repository paths `path` cites (see the module docstring for what counts)."""
    text = re.sub(r"https?://\S+", "", path.read_text())   # links are not repository files
    out = []
    for ref in (m.group(1) for m in REF.finditer(text)):
        head = ref.split("/", 1)[0]
        if "/" in ref and (head in TOP or head in MODULES):
            out.append(ref)
        elif "/" not in ref and (re.fullmatch(r"[A-Z][A-Z_]*\.md", ref) or path.parent.name == "results"):
            out.append(ref)
    return out


def resolves(ref: str, where: Path) -> bool:
    for base in (ROOT, where.parent, ROOT / "solrl"):
        if (base / ref).exists():
            return True
    if where.parent.name == "results" and re.fullmatch(r"tests/test_\w+\.py", ref):   # moved since, name kept
        return len(list((ROOT / "tests").glob("*/" + ref.split("/")[1]))) == 1
    ignored = subprocess.run(["git", "check-ignore", "-q", ref], cwd=ROOT, check=False)
    return ignored.returncode == 0


def test_every_cited_file_exists():
    missing = [f"{p.relative_to(ROOT)}: {ref}" for p in DOCS for ref in references(p) if not resolves(ref, p)]
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_the_scanner_finds_what_it_should(tmp_path):
    doc = tmp_path / "results" / "x.md"
    doc.parent.mkdir()
    doc.write_text("see `docs/method.md`, METHOD.md, rollout.md, algo/nft.py and flow_grpo/ocr.py; "
                   "run outputs metrics.jsonl; not https://example.org/docs/a.md")
    assert references(doc) == ["docs/method.md", "METHOD.md", "rollout.md", "algo/nft.py", "metrics.jsonl"]
    assert resolves("docs/method.md", doc) and resolves("algo/nft.py", doc)
    assert not resolves("METHOD.md", doc) and not resolves("rollout.md", doc)
    assert resolves("k8s/overlays/b200/adapter-token.txt", doc)   # git-ignored: the user writes it
    assert resolves("tests/test_loop.py", doc) and not resolves("tests/test_loop.py", ROOT / "docs" / "x.md")
    assert not resolves("tests/test_no_such_file.py", doc)
    assert "docs/method.md" in {r for p in DOCS for r in references(p)}
