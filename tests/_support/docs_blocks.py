"""The Python examples of the README and of docs/*.md (tests/test_docs_examples.py runs them;
tests/_support/docs_worker.py runs those that need ranks of their own)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(f"docs/{p}" for p in os.listdir(os.path.join(ROOT, "docs"))
                               if p.endswith(".md"))


def blocks() -> dict:
    """(page, index) -> the code of every ```python block of the README and docs/."""
    out = {}
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for i, m in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
            out[(page, i)] = m.group(1)
    return out
