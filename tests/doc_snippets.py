"""The code blocks of docs/enable.md, by name: each fenced block follows a `<!-- snippet: NAME -->`
line, and the tests that run it read it from here, so a published snippet is a run one."""

import re
from pathlib import Path

ENABLE_MD = Path(__file__).parents[1] / "docs" / "enable.md"
SNIPPET = re.compile(r"<!-- snippet: (?P<name>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<body>.*?)\n```\n",
                     re.S)


def snippets() -> dict:
    """{name: (language, text)} of every named block in docs/enable.md."""
    return {m["name"]: (m["lang"], m["body"]) for m in SNIPPET.finditer(ENABLE_MD.read_text())}


def snippet(name: str) -> str:
    """The text of the block named `name`."""
    return snippets()[name][1]


def run_snippet(name: str, **names) -> dict:
    """Execute the python block `name` with `names` bound; its namespace afterwards."""
    language, text = snippets()[name]
    assert language == "python", f"snippet {name} is {language}, not python"
    namespace = dict(names)
    exec(compile(text, f"docs/enable.md:{name}", "exec"), namespace)
    return namespace
