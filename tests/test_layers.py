"""The package's import graph: no module imports itself back through others (zero cycles), and the
layer contracts in pyproject.toml hold (the same check `lint-imports` runs in CI)."""

import grimp


def cycles(graph) -> list[list[str]]:
    """Every import cycle among the package's modules, each once (by depth-first search)."""
    found, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(module, path):
        state[module] = 1
        path.append(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if not other.startswith("optimisers"):
                continue
            if state.get(other) == 1:
                found.append(path[path.index(other) :] + [other])
            elif other not in state:
                visit(other, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph.modules):
        if module.startswith("optimisers") and module not in state:
            visit(module, [])
    return found


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("optimisers")
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in (("a", "b"), ("b", "c"), ("c", "a")):
        graph.add_import(importer=f"optimisers.{a}", imported=f"optimisers.{b}")
    assert cycles(graph) == [["optimisers.a", "optimisers.b", "optimisers.c", "optimisers.a"]]


def test_layer_contracts_hold():
    from importlinter.cli import lint_imports

    assert lint_imports() == 0
