"""Every import in ``src/draftwise`` points down, and no module imports itself round a loop.

The allowed order is written down once, in ``LAYERS``, lowest first. A module may import any
module of a lower layer, and any module of its own unit (a unit is a package, or a set of
top-level modules); it may not import a unit above it, nor another unit of its own layer
(the services of one layer stay independent of one another).

Every top-level module and package is named in ``LAYERS``: the core of speculative decoding
(the top-level modules below the backends) is ordered too, from the errors and the model seam
up to the decode loop, so that a module low in it (``verify``) cannot come to import one above
it (``engine``). A new module fails ``test_every_module_has_a_layer`` until it is given a place.

Every ``draftwise`` import counts, wherever it stands: at module level, inside a function (the
CLI and the servers import lazily, to start fast) or under ``if TYPE_CHECKING:``. A lazy or
type-only import is still a dependency of the code that holds it, and a loop through one is
still a loop a reader has to untangle, so none is exempt.

Importing ``draftwise.a.b`` also runs the ``__init__`` of ``draftwise`` and ``draftwise.a``;
those implicit imports of parent packages are not edges here, only the names a module asks for.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

import draftwise

PACKAGE = Path(draftwise.__file__).parent

# Lowest first. Each layer is a tuple of units; each unit a package or a set of modules.
LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    # the foundation, importing no other draftwise module: errors, settings, the CPU, the model seam
    (("draftwise.errors", "draftwise.config", "draftwise.cpu", "draftwise.lm", "draftwise.scale"),),
    # text over the model seam (chat prompts, other vocabularies, stops); the packaged models;
    # the HTTP guards both servers share
    (
        ("draftwise.chat", "draftwise.retokenize", "draftwise.tokenizer_compat", "draftwise.stopping"),
        ("draftwise.registry", "draftwise.pull"),
        ("draftwise.web",),
    ),
    # the model backends: transformers and llama.cpp behind the LanguageModel seam, below
    # everything that runs a model (their kernel choice is timed from above, draftwise.costs)
    (("draftwise.backends",),),
    # verification: the acceptance rule, the step event it yields, the metrics built from events
    (("draftwise.verify", "draftwise.events", "draftwise.metrics"),),
    # below the drafters, each apart: the draft policies (which source drafts, how many tokens),
    # with what they are offered and learn (offers) and the costs they measure (profile); and a
    # request's grammar compiled (grammar) to one stream's masks and forced tokens (constraint)
    (("draftwise.offers", "draftwise.profile", "draftwise.policies"), ("draftwise.constraint", "draftwise.grammar")),
    # the drafters: the protocol every proposer speaks; model drafters (by ids or text), n-grams
    (("draftwise.drafters",),),
    # what stands on the drafters, each apart: predicted outputs, earlier outputs (suffix),
    # drafting under a grammar, the target side, and the measured cost of drafting (for the
    # cost policy)
    (
        ("draftwise.prediction",),
        ("draftwise.suffix",),
        ("draftwise.constrained",),
        ("draftwise.target",),
        ("draftwise.costs",),
    ),
    # the decode loop of one generation, and the scheduler that runs many streams' passes in
    # rounds (it runs the engine's steps without importing the engine), with its pacing of
    # long prompts beside them
    (("draftwise.engine",), ("draftwise.scheduler", "draftwise.pacing")),
    # picking a backend for a source, preparing a pair, and the package's public names
    (("draftwise.loading", "draftwise.prepare", "draftwise"),),
    # the services that run on one process's models: the bench, the OpenAI API, the verifier
    (("draftwise.bench",), ("draftwise.api",), ("draftwise.remote",)),
    # the services built on those: the dashboard, the load bench, all of them on Ray
    (("draftwise.dashboard",), ("draftwise.loadbench",), ("draftwise.cluster",)),
    # the command line, which chooses among them
    (("draftwise.cli",),),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: Iterable[str]) -> Iterator[str]:
    """The draftwise modules one import statement names: ``from a import b`` names module
    ``a.b`` when there is one, else (a name defined in ``a``) module ``a``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name.split(".")[0] == "draftwise")
        return
    if not isinstance(node, ast.ImportFrom):
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    if base.split(".")[0] != "draftwise":
        return
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        yield candidate if candidate in known else base


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the draftwise modules it imports, from every import statement in it (see above)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {
            target for node in ast.walk(tree) for target in _imported(node, name, is_package, modules) if target != name
        }
    return graph


def unit_of(module: str) -> tuple[int, str]:
    """(layer index, unit) of ``module``: the unit whose name is the longest prefix of it."""
    best: tuple[int, str, int] | None = None
    for rank, layer in enumerate(LAYERS):
        for unit in layer:
            for prefix in unit:
                # "draftwise" names the package's own __init__, not everything under it.
                inside = prefix != "draftwise" and module.startswith(prefix + ".")
                if (module == prefix or inside) and (best is None or len(prefix) > best[2]):
                    best = (rank, unit[0], len(prefix))
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it (or its package) to a unit of LAYERS")
    return best[0], best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer, or of another unit of the same layer."""
    wrong = []
    for module, targets in sorted(graph.items()):
        rank, unit = unit_of(module)
        for target in sorted(targets):
            target_rank, target_unit = unit_of(target)
            if target_rank > rank or (target_rank == rank and target_unit != unit):
                wrong.append(f"{module} (layer {rank}, {unit}) imports {target} (layer {target_rank}, {target_unit})")
    return wrong


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph(all_modules())
    assert "draftwise.loading" in graph["draftwise.prepare"]  # module level
    assert "draftwise.backends.llamacpp" in graph["draftwise.loading"]  # inside a function
    assert "draftwise.config" in graph["draftwise"]  # under TYPE_CHECKING
    assert "draftwise.api.schemas" in graph["draftwise.api.app"]  # from a package import a module


def test_every_module_has_a_layer():
    for module in all_modules():
        unit_of(module)
    with pytest.raises(AssertionError, match="add it"):  # a new top-level module, not yet placed
        unit_of("draftwise.newcomer")


def test_every_name_in_the_layers_is_a_module():
    """A module renamed or removed leaves no stale name behind in ``LAYERS``. (A package need
    not have an ``__init__``: ``draftwise.backends`` has none.)"""
    modules = all_modules()
    names = [name for layer in LAYERS for unit in layer for name in unit]
    assert [n for n in names if n not in modules and not any(m.startswith(n + ".") for m in modules)] == []


def test_no_import_points_up_or_across():
    assert upward_imports(import_graph(all_modules())) == []


def test_no_import_loops():
    assert cycles(import_graph(all_modules())) == []


def test_the_checks_catch_a_planted_loop_and_upward_import():
    """The checks themselves, on a copy of the graph with five wrong imports added."""
    graph = import_graph(all_modules())
    graph["draftwise.config"].add("draftwise.engine")  # engine imports config: a loop
    graph["draftwise.api.settings"].add("draftwise.cluster.fleet")  # a service below cluster
    graph["draftwise.bench.config"].add("draftwise.api.settings")  # a service of its own layer
    graph["draftwise.verify"].add("draftwise.engine")  # inside the core: verification below the loop
    graph["draftwise.web"].add("draftwise.chat")  # inside the core: a unit of its own layer
    assert any({"draftwise.config", "draftwise.engine"} <= set(group) for group in cycles(graph))
    wrong = upward_imports(graph)
    assert any(line.startswith("draftwise.api.settings ") and "cluster.fleet" in line for line in wrong)
    assert any(line.startswith("draftwise.bench.config ") and "api.settings" in line for line in wrong)
    assert any(line.startswith("draftwise.verify ") and "draftwise.engine " in line for line in wrong)
    assert any(line.startswith("draftwise.web ") and "draftwise.chat " in line for line in wrong)
