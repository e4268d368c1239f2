"""The docs pages and README: their code fits the page, every public name has an API entry, and
every docstring example passes. tests/test_docs_blocks.py runs the ```python blocks.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import optimisers

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.DOTALL | re.MULTILINE
)


def code_blocks(page: Path) -> list[tuple[int, str]]:
    """`(line, code)` for each ```python block of `page`, `line` being its first line of code."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group("lang") not in ("python", "py"):
            continue
        indent = m.group("indent")
        body = "\n".join(
            line[len(indent) :] if line.startswith(indent) else line for line in m.group("body").splitlines()
        )
        line = text.count("\n", 0, m.start()) + 2
        blocks.append((line, body))
    return blocks


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _undefined_names(code: str) -> set[str]:
    """Names a block reads at module level (directly or from its functions) without defining or
    importing them, builtins aside."""
    import builtins
    import symtable

    top = symtable.symtable(code, "<block>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    out = set()

    def visit(table):
        for s in table.get_symbols():
            name = s.get_name()
            if s.is_referenced() and (table is top or s.is_global()) and name not in defined:
                out.add(name)
        for child in table.get_children():
            visit(child)

    visit(top)
    return {n for n in out if not hasattr(builtins, n)}


def test_readme_blocks_run_on_their_own():
    """A reader copies one README example, not the page: no README block continues another (the
    docs pages may mark one that does, see test_docs_blocks.py)."""
    for line, code in code_blocks(ROOT / "README.md"):
        assert not _undefined_names(code), f"README.md:{line} uses {sorted(_undefined_names(code))}"


def test_undefined_names_are_found():
    assert _undefined_names("import numpy as np\nx = np.ones(2)\nprint(x)") == set()
    assert _undefined_names("def f():\n    return opt.Adam()\n") == {"opt"}
    assert _undefined_names("y = [opt for _ in range(2)]") == {"opt"}


def test_code_lines_fit_the_page():
    """The docs theme clips code at about 88 characters (1280 px wide screens)."""
    fence = re.compile(r"^[ \t]*```")
    long = []
    for page in PAGES:
        inside = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if fence.match(line):
                inside = not inside
            elif inside and len(line) > 88:
                long.append(f"{_page_id(page)}:{number} ({len(line)} characters)")
    assert not long, "code lines longer than 88 characters: " + ", ".join(long)


def test_every_page_has_tested_code_or_is_reference():
    prose_only = {"index.md", "api.md", "comparison.md"}
    for page in DOCS.glob("*.md"):
        if page.name not in prose_only:
            assert code_blocks(page), f"{page.name} has no python code block"


def _modules():
    names = ["optimisers"]
    for info in pkgutil.walk_packages(optimisers.__path__, "optimisers."):
        if not info.name.endswith("__main__"):  # importing it runs the command line
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    """Docstrings with `>>>` examples run as doctests (backend modules need their framework)."""
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_api_page_lists_every_public_name():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.undocumented((DOCS / "api.md").read_text(encoding="utf-8")) == []


def test_nav_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        assert f" {page.name}" in config, f"{page.name} is not in mkdocs.yml's nav"


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to missing {target}"


def test_readme_quick_start_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e ".[demo]" && optimisers demo' in text
    assert 'pip install -e ".[test]" && python3 -m pytest' in text
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == ['pip install -e ".[demo]" && optimisers demo',
                                  'pip install -e ".[test]" && python3 -m pytest']
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m pytest" in ci and "mkdocs build --strict" in ci


def test_import_is_light():
    """The docs promise that `import optimisers` pulls in neither torch nor jax."""
    import subprocess

    code = "import sys, optimisers; print('torch' in sys.modules, 'jax' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
