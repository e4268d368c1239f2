"""The tools (`optimisers.tools`: the command line, the demo, the bench) use the library only
through its public API, as a user's program would; the library itself never imports them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import optimisers

PACKAGE = Path(optimisers.__file__).parent
TOOLS = PACKAGE / "tools"
PUBLIC_MODULES = {
    "optimisers", "optimisers.torch", "optimisers.optax", "optimisers.schedules", "optimisers.ops"
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, module: str, is_package: bool = False):
    """`(line, absolute module, imported name or None)` for every import in `source`, the text of
    `module` (relative imports resolved against it)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, base, alias.name


def _file_imports(path: Path):
    return _imports(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")


def _private_use(module: str, name: str | None) -> bool:
    """Whether importing `name` from `module` reaches past the library's public API."""
    if module.partition(".")[0] != "optimisers" or module.startswith("optimisers.tools"):
        return False
    if module not in PUBLIC_MODULES:
        return True
    if module == "optimisers" and name is not None:
        return name not in optimisers.__all__ and name not in ("torch", "optax", "tools", "__version__")
    return name is not None and name.startswith("_")


def _private_attributes(source: str):
    """`(line, attribute)` for each `opt._x` where `opt` names the optimisers package."""
    tree = ast.parse(source)
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names if a.name == "optimisers"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and node.attr not in ("__version__", "__all__")):
            yield node.lineno, node.attr


def _private_reaches(source: str, module: str, is_package: bool = False) -> list[str]:
    found = [f"line {line}: {mod} {name or ''}".rstrip()
             for line, mod, name in _imports(source, module, is_package) if _private_use(mod, name)]
    return found + [f"line {line}: optimisers.{attr}" for line, attr in _private_attributes(source)]


TOOL_FILES = sorted(TOOLS.rglob("*.py"))


def test_the_tools_are_all_found():
    names = {_module_name(p) for p in TOOL_FILES}
    assert {"optimisers.tools.cli", "optimisers.tools.demo", "optimisers.tools.bench.command"} <= names


@pytest.mark.parametrize("path", TOOL_FILES, ids=lambda p: str(p.relative_to(TOOLS)))
def test_tools_import_only_public_names(path):
    source = path.read_text(encoding="utf-8")
    found = _private_reaches(source, _module_name(path), path.name == "__init__.py")
    assert found == [], f"{path.name} reaches into the library's private parts"


def test_the_scan_catches_each_way_of_reaching_a_private_part():
    module = "optimisers.tools.bench.models"
    assert _private_reaches("from optimisers import _rules", module) == ["line 1: optimisers _rules"]
    assert _private_reaches("from optimisers._rules import Adam", module) != []
    assert _private_reaches("import optimisers.backends._numpy", module) != []
    assert _private_reaches("from ... import _engine", module) == ["line 1: optimisers _engine"]
    assert _private_reaches("from ..._state import State", module) == ["line 1: optimisers._state State"]
    assert _private_reaches("import optimisers as o\no._interface.setup", module) == [
        "line 2: optimisers._interface"
    ]
    # what the tools may do
    public = "import optimisers as opt\nfrom optimisers import Adam\nfrom optimisers.torch import AdamW\n"
    public += "from .. import demo\nfrom . import _models\nopt.__version__\n"
    assert _private_reaches(public, module) == []


def test_the_library_never_imports_the_tools():
    for path in sorted(PACKAGE.rglob("*.py")):
        if TOOLS in path.parents or path.name == "__main__.py":  # the command's entry point
            continue
        tools = [line for line, module, name in _file_imports(path)
                 if module.startswith("optimisers.tools") or (module == "optimisers" and name == "tools")]
        assert tools == [], f"{path.relative_to(PACKAGE)} imports the tools at line(s) {tools}"
