"""docs/ is one page per subject, each short enough to read, each linked from the README's docs map, and every
reference to a page or a section of one points at something that is there: a markdown link or anchor in
README.md, BENCHMARKS.md and docs/*.md, a `docs/X.md "Section"` named in a page or in the code, and any
`docs/X.md` a code, test, benchmark or profile string names (error messages users read among them)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_PAGE_LINES = 280
LINKING_DOCS = ("README.md", "BENCHMARKS.md")
SOURCE_DIRS = ("dflash", "launcher_core", "envcheck", "scripts", "tests", "benchmarks", "profiles")
SOURCE_SUFFIXES = (".py", ".toml", ".txt", ".sh")
SOURCE_FILES = ("launcher.py", "pyproject.toml", ".ci/run")
THIS_TEST = "tests/test_docs_pages.py"    # its page names are examples of faults

GENERATED = re.compile(r"<!-- generated: (\S+).*?<!-- end generated: \1 -->", re.DOTALL)
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGE_MENTION = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)(#[\w-]*)?")
DOCS_PAGE = re.compile(r"(?<![\w/.-])docs/([\w-]+)\.md")
# `docs/X.md "Section"`, `docs/X.md, "Section"`, `docs/X.md ("Section")`, and a list: `docs/X.md, "A", "B"`
SECTION_REFERENCE = re.compile(r'(?<![\w/.-])docs/([\w-]+)\.md[,:]?\s*\(?((?:"[A-Za-z`][^"\n]{0,79}"(?:,\s*)?)+)')


@dataclass(frozen=True)
class Problem:
    """One broken promise of the docs: where it is, and what is wrong."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def doc_pages(root: Path) -> list[Path]:
    return sorted((root / "docs").glob("*.md"))


def hand_written_lines(text: str) -> int:
    """The page's lines, a generated table's lines (between its markers) not counted."""
    return len(GENERATED.sub("", text).splitlines())


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, each with its line number."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[str]:
    return [match.group(2) for _, line in prose_lines(text) if (match := HEADING.match(line))]


def anchors(text: str) -> set[str]:
    """Every heading's anchor, a repeated one with GitHub's -1, -2, ... suffix."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(text):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def section_key(text: str) -> str:
    """A heading or a quoted section name compared without case, backticks or line breaks."""
    return " ".join(text.replace("`", "").split()).lower()


def pages_too_long(root: Path) -> list[Problem]:
    return [Problem(f"docs/{page.name}", f"{count} lines outside generated tables, more than {MAX_PAGE_LINES}: "
                                         "split it by subject")
            for page in doc_pages(root) if (count := hand_written_lines(page.read_text(encoding="utf-8"))) > MAX_PAGE_LINES]


def pages_not_in_the_readme(root: Path) -> list[Problem]:
    linked = set(MARKDOWN_LINK.findall((root / "README.md").read_text(encoding="utf-8")))
    return [Problem(f"docs/{page.name}", "not linked from README.md's docs map")
            for page in doc_pages(root) if f"docs/{page.name}" not in linked]


def broken_markdown_references(root: Path) -> list[Problem]:
    """Links and mentions of a page (`docs/X.md`, `X.md#anchor`) in README.md, BENCHMARKS.md and docs/*.md:
    the page exists, and so does the anchor's heading. Paths resolve against the file that names them, and
    a bare `docs/...` mention against the repository root."""
    problems = []
    for path in [root / name for name in LINKING_DOCS if (root / name).is_file()] + doc_pages(root):
        where = path.relative_to(root).as_posix()
        for number, line in prose_lines(path.read_text(encoding="utf-8")):
            targets = [(target, True) for target in MARKDOWN_LINK.findall(line) if ".md" in target
                       and "://" not in target]
            line_without_links = MARKDOWN_LINK.sub("", line)
            targets += [(name + (anchor or ""), False) for name, anchor in PAGE_MENTION.findall(line_without_links)
                        if name.startswith("docs/") or anchor]
            for target, is_link in targets:
                problems += check_target(root, path, target, is_link, f"{where}:{number}")
    return problems


def check_target(root: Path, source: Path, target: str, is_link: bool, where: str) -> list[Problem]:
    name, _, anchor = target.partition("#")
    page = (source.parent / name) if is_link or not name.startswith("docs/") else (root / name)
    if not page.resolve().is_file():
        page = root / name if name.startswith("docs/") else root / "docs" / name
    if not page.is_file():
        return [Problem(where, f"{target}: no such page")]
    if anchor and anchor not in anchors(page.read_text(encoding="utf-8")):
        return [Problem(where, f"{target}: {page.relative_to(root).as_posix()} has no heading with anchor #{anchor}")]
    return []


def source_files(root: Path) -> list[Path]:
    files = [path for folder in SOURCE_DIRS for path in (root / folder).rglob("*")
             if path.suffix in SOURCE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts]
    files += [path for path in root.glob("requirements*.txt")]
    files += [root / name for name in SOURCE_FILES if (root / name).is_file()]
    return sorted(set(files) - {root / THIS_TEST})


def joined(text: str, python: bool) -> str:
    """The text with its line breaks (and a comment's or docstring's continuation) as spaces, so a reference
    wrapped over two lines reads as one; in Python source, an escaped quote as a quote."""
    if python:
        text = text.replace('\\"', '"')
    return re.sub(r"\n\s*(?:#\s*)?", " ", text)


def broken_page_names(root: Path) -> list[Problem]:
    """A `docs/X.md` in the code, tests, benchmarks, scripts or profiles names a page that exists."""
    pages = {page.stem for page in doc_pages(root)}
    problems = []
    for path in source_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            problems += [Problem(f"{path.relative_to(root).as_posix()}:{number}", f"docs/{name}.md: no such page")
                         for name in DOCS_PAGE.findall(line) if name not in pages]
    return problems


def broken_section_names(root: Path) -> list[Problem]:
    """A `docs/X.md "Section"` (in the docs, the README or the code) names a heading of that page: the quoted
    words are a heading's or the start of one, as `"Exporting"` is of `## Exporting: launcher.py export ...`."""
    sections = {page.stem: [section_key(heading) for heading in headings(page.read_text(encoding="utf-8"))]
                for page in doc_pages(root)}
    problems = []
    for path in [root / name for name in LINKING_DOCS if (root / name).is_file()] + doc_pages(root) + source_files(root):
        text = joined(path.read_text(encoding="utf-8", errors="replace"), python=path.suffix == ".py")
        for page, quoted in SECTION_REFERENCE.findall(text):
            for name in re.findall(r'"([^"]+)"', quoted):
                if page in sections and not any(heading.startswith(section_key(name)) for heading in sections[page]):
                    problems.append(Problem(path.relative_to(root).as_posix(),
                                            f'docs/{page}.md "{name}": that page has no such heading'))
    return problems


def test_no_docs_page_is_much_over_250_lines():
    assert [str(problem) for problem in pages_too_long(REPO)] == []


def test_the_readme_links_every_docs_page():
    assert [str(problem) for problem in pages_not_in_the_readme(REPO)] == []


def test_every_page_and_anchor_the_docs_link_to_is_there():
    assert [str(problem) for problem in broken_markdown_references(REPO)] == []


def test_every_docs_page_the_code_names_is_there():
    assert [str(problem) for problem in broken_page_names(REPO)] == []


def test_every_section_a_docs_reference_names_is_a_heading_of_its_page():
    assert [str(problem) for problem in broken_section_names(REPO)] == []


def write(root: Path, name: str, text: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding="utf-8")


def test_each_check_finds_what_it_is_for(tmp_path):
    """A small repository with one of each fault: every check names it, and the faultless parts pass."""
    gone = "gone"      # spelled apart, so this file itself names no missing page
    write(tmp_path, "README.md", "# x\n\n- [docs/a.md](docs/a.md): a\n- [docs/a.md#the-end](docs/a.md#the-end)\n"
                                 f"- [docs/a.md#nowhere](docs/a.md#nowhere)\n- docs/{gone}.md\n")
    write(tmp_path, "BENCHMARKS.md", "[link](docs/a.md#a-heading-with-code_and-punctuation)\n")
    generated = "<!-- generated: t (x) -->\n" + "| row |\n" * 400 + "<!-- end generated: t -->\n"
    write(tmp_path, "docs/a.md", "# A\n\n## A heading with `code_and` punctuation!\n\n```\n# not a heading\n```\n\n"
                                 '## The end\n\nsee docs/b.md, "Long page" and docs/a.md "Not there"\n' + generated)
    write(tmp_path, "docs/b.md", "# Long page\n" + "text\n" * MAX_PAGE_LINES)
    write(tmp_path, "dflash/x.py", f'"""Rules: docs/a.md "The end"; docs/{gone}.md."""\nERROR = "read docs/b.md \\"Long"\n')

    assert [str(p) for p in pages_too_long(tmp_path)] == [f"docs/b.md: {MAX_PAGE_LINES + 1} lines outside generated "
                                                          f"tables, more than {MAX_PAGE_LINES}: split it by subject"]
    assert [str(p) for p in pages_not_in_the_readme(tmp_path)] == ["docs/b.md: not linked from README.md's docs map"]
    assert [str(p) for p in broken_markdown_references(tmp_path)] == [
        "README.md:5: docs/a.md#nowhere: docs/a.md has no heading with anchor #nowhere",
        f"README.md:6: docs/{gone}.md: no such page"]
    assert [str(p) for p in broken_page_names(tmp_path)] == [f"dflash/x.py:1: docs/{gone}.md: no such page"]
    assert [str(p) for p in broken_section_names(tmp_path)] == ['docs/a.md: docs/a.md "Not there": that page has no '
                                                                "such heading"]


def test_a_github_anchor_is_the_heading_lowercased_without_punctuation():
    assert github_anchor("`launcher.py status RUN_DIR` (or `--profile P`)") == "launcherpy-status-run_dir-or---profile-p"
    assert github_anchor("Rendezvous: loopback only") == "rendezvous-loopback-only"
    assert anchors("## Benchmark\n\n## Benchmark\n") == {"benchmark", "benchmark-1"}
