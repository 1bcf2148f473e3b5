"""The user documentation (README.md, docs/**/*.md, benchmarks/README.md) keeps a short front
door, speaks to users rather than about how it was built, and points only at files that
exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# benchmarks/README.md is where the docs send a reader who wants to run the suite.
USER_DOCS = sorted([README, ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/**/*.md")])

RUN_LOGS = sorted(ROOT.glob("docs/runs/*.md"))  # dated benchmark logs, one per run

README_LIMIT_BYTES = 12 * 1024

# Words of the development process, not of the product: a user page that needs one is telling
# the builders' history (that lives in commit messages).
PROCESS_WORDS = (
    "session",
    "this round",
    "previous session",
    "DESIGN.md",
    "seeds/",
    "device call",
    "nvidia-h100-x",
    "nvidia-h200",
    "the issue",
)
# A numbered issue or pull request is development history too ("issue 14's additions").
NUMBERED_ISSUE = re.compile(r"\b(?:issue|PR|pull request) #?\d+", flags=re.IGNORECASE)

# [text](target) and ![alt](target); the target ends at whitespace or ")".
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DATA_FILE = re.compile(r"docs/data/[A-Za-z0-9_.\-]+\.(?:csv|jsonl|txt|tgz)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _links(text: str) -> list[str]:
    return MARKDOWN_LINK.findall(text)


def _anchors(doc: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")


def test_user_docs_are_found():
    names = {_rel(p) for p in USER_DOCS}
    assert {"README.md", "docs/benchmarks.md", "docs/usage.md"} <= names
    assert RUN_LOGS and all(log in USER_DOCS for log in RUN_LOGS)


def test_readme_is_under_12_kib():
    size = README.stat().st_size
    assert size < README_LIMIT_BYTES, f"README.md is {size} bytes; move detail to docs/"


def test_readme_starts_with_the_two_fresh_machine_commands():
    lines = README.read_text().splitlines()
    fence = lines.index("```bash")
    commands = lines[fence + 1 : fence + 3]
    assert fence <= 3, "the fenced commands must be the README's first lines"
    assert "python examples/sft.py" in commands[0]
    assert "python -m pytest" in commands[1]
    assert lines[fence + 3] == "```"


@pytest.mark.parametrize("doc", USER_DOCS, ids=_rel)
def test_no_development_process_words(doc):
    text = doc.read_text()
    found = [
        f"{word!r} on line {text[: m.start()].count(chr(10)) + 1}"
        for word in PROCESS_WORDS
        for m in re.finditer(re.escape(word), text, flags=re.IGNORECASE)
    ]
    found += [
        f"{m.group()!r} on line {text[: m.start()].count(chr(10)) + 1}"
        for m in NUMBERED_ISSUE.finditer(text)
    ]
    assert not found, f"{_rel(doc)} speaks of how it was built: {', '.join(found)}"


@pytest.mark.parametrize("doc", USER_DOCS, ids=_rel)
def test_relative_links_point_at_existing_files(doc):
    broken = []
    for target in _links(doc.read_text()):
        if not _is_relative(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve()
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{_rel(doc)} links to missing files or headings: {broken}"


@pytest.mark.parametrize("doc", USER_DOCS, ids=_rel)
def test_named_data_files_exist(doc):
    missing = sorted({n for n in DATA_FILE.findall(doc.read_text()) if not (ROOT / n).exists()})
    assert not missing, f"{_rel(doc)} names data files that are not in the repository: {missing}"


@pytest.mark.parametrize("doc", USER_DOCS, ids=_rel)
def test_python_blocks_parse(doc):
    # A snippet a reader copies must at least be Python: compiled, not run.
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL)):
        compile(block, f"{_rel(doc)} python block {i + 1}", "exec")


@pytest.mark.parametrize("log", RUN_LOGS, ids=_rel)
def test_a_run_log_says_how_to_repeat_it(log):
    # A dated log: what ran (a command), on what (hardware, software, commit), and its raw data.
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", log.name), log.name
    text = log.read_text()
    fields = ("**Date", "**Hardware:**", "**Software:**", "**Commit", "```bash")
    missing = [field for field in fields if field not in text]
    has_data = "](../data/" in text or "No CSV" in text or "no CSV" in text
    assert not missing and has_data, f"{_rel(log)} lacks {missing or 'a link to its raw data'}"


def test_the_checks_catch_what_they_guard(tmp_path):
    # The link pattern sees both kinds of link, and the process-word check is case-blind.
    text = 'a [log](runs/x.md#part) and ![plot](../p.png "t") and [site](https://x.org)'
    assert _links(text) == ["runs/x.md#part", "../p.png", "https://x.org"]
    assert [t for t in _links(text) if _is_relative(t)] == ["runs/x.md#part", "../p.png"]
    assert DATA_FILE.findall("see `docs/data/a_b-1.csv`.") == ["docs/data/a_b-1.csv"]
    assert re.search(re.escape("device call"), "One Device Call", flags=re.IGNORECASE)
    assert NUMBERED_ISSUE.search("as of issue 14's additions")
    assert not NUMBERED_ISSUE.search("an issue with 2 ranks")
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## The SuperOffload trainers against the plain `Trainer`\n")
    assert _anchors(page) == {"top", "the-superoffload-trainers-against-the-plain-trainer"}
