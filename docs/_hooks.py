"""mkdocs hook: fail the build when a public name of `optimisers` is missing from the API page.

mkdocstrings renders what the page asks for and says nothing about what it leaves out, so this
checks that every name in `optimisers.__all__` has its own `::: optimisers.NAME` entry in
docs/api.md and a docstring.
"""

from __future__ import annotations

import os
import re

from mkdocs.exceptions import PluginError


def undocumented(api_text: str) -> list[str]:
    import optimisers

    entries = set(re.findall(r"^::: optimisers\.(\w+)", api_text, re.MULTILINE))
    problems = []
    for name in optimisers.__all__:
        if name not in entries:
            problems.append(f"{name} (no '::: optimisers.{name}' entry)")
        elif not (getattr(optimisers, name).__doc__ or "").strip():
            problems.append(f"{name} (no docstring)")
    return problems


def on_pre_build(config, **kwargs):
    with open(os.path.join(config["docs_dir"], "api.md"), encoding="utf-8") as f:
        problems = undocumented(f.read())
    if problems:
        raise PluginError("public names missing from docs/api.md: " + ", ".join(problems))
