"""The code blocks of docs/enable.md (and docs/automodel.md), by name: each fenced block follows
a `<!-- snippet: NAME -->` line, and the tests that run it read it from here, so a published
snippet is a run one."""

import re
from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs"
ENABLE_MD = DOCS / "enable.md"
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
