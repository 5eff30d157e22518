"""The code blocks of README.md and docs/*.md, by name: each fenced block with a language follows
a `<!-- snippet: NAME -->` line, and the tests that run it read it from here, so a published
snippet is a run one. A fence without a language quotes someone else's code or output."""

import re
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs"
ENABLE_MD = DOCS / "enable.md"
README_MD = DOCS.parent / "README.md"
PUBLISHED = (README_MD, *sorted(DOCS.glob("*.md")))  # every page a user reads
CODE_FENCE = re.compile(r"^```(\w+)\n", re.M)  # an opening fence that names its language
SNIPPET = re.compile(r"<!-- snippet: (?P<name>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<body>.*?)\n```\n",
                     re.S)


def snippets(doc: Path = ENABLE_MD) -> dict:
    """{name: (language, text)} of every named block in `doc`."""
    return {m["name"]: (m["lang"], m["body"]) for m in SNIPPET.finditer(doc.read_text())}


def snippet(name: str, doc: Path = ENABLE_MD) -> str:
    """The text of the block named `name`."""
    return snippets(doc)[name][1]


def run_snippet(name: str, doc: Path = ENABLE_MD, **names) -> dict:
    """Execute the python block `name` of `doc` with `names` bound; its namespace afterwards."""
    language, text = snippets(doc)[name]
    assert language == "python", f"snippet {name} is {language}, not python"
    namespace = dict(names)
    exec(compile(text, f"docs/{doc.name}:{name}", "exec"), namespace)
    return namespace


def code_blocks(doc: Path) -> int:
    """How many fenced blocks of `doc` name a language (python, bash, yaml)."""
    return len(CODE_FENCE.findall(doc.read_text()))
