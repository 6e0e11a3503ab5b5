"""The layering of docs/architecture.md, checked on the source: a module imports only its own layer and the layers
below it, so that the IR can be read, tested and reused without the verifier, the simulator or torch.

Every import statement counts, including those inside functions and under `if TYPE_CHECKING:`: a late import
still ties the lower layer to the higher one (a cycle ir -> verify -> passes -> ir was one).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipec"

# Lowest first. A module belongs to the longest prefix listed; it may import its own layer and those below. A new
# module that matches only `pipec` lands in the top layer, so a lower module importing it fails until it is placed.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pipec.errors", "pipec.limits", "pipec.gcpause", "pipec.outputs"),  # leaves every layer may use
    ("pipec.ir", "pipec.p2p_rule"),  # the IR and the point-to-point rule every engine applies
    ("pipec.frontend", "pipec.passes", "pipec.library"),
    ("pipec.verify", "pipec.emit"),
    ("pipec.sim", "pipec.compiler"),  # the simulator runs the verifier's liveness and p2p engines
    ("pipec.viz",),
    ("pipec.testing", "pipec.runtime", "pipec.tune"),  # tune searches with the test kit's parameter spaces
    ("pipec", "pipec.torch", "pipec.hf", "pipec.cli", "pipec.run", "pipec.__main__"),  # the API, the command line
)
TORCH_USERS = ("pipec.runtime", "pipec.torch", "pipec.hf")
TRANSFORMERS_USERS = ("pipec.hf",)  # the optional extra pipec[hf]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, level = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    assert level >= 0, f"{module} is not a pipec module"
    return level


def is_module(name: str) -> bool:
    """Whether a dotted name is a pipec module or package (as opposed to a name defined in one)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """The absolute names of the modules some source imports (relative imports resolved), anywhere in it."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            names.add(target)
            # `from pipec import verify` imports the module pipec.verify, not only a name of pipec/__init__.py
            names.update(f"{target}.{a.name}" for a in node.names if is_module(f"{target}.{a.name}"))
    return names


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")


def upward(module: str, names: set[str]) -> list[str]:
    """The pipec modules among `names` in a layer above `module`'s."""
    level = layer_of(module)
    return sorted(n for n in names if (n == "pipec" or n.startswith("pipec.")) and layer_of(n) > level)


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_stay_in_layer(path: Path) -> None:
    module = module_name(path)
    higher = upward(module, imports_of(path))
    level = layer_of(module)
    assert not higher, (
        f"{module} (layer {level}: {', '.join(LAYERS[level])}) imports {', '.join(higher)} from a higher layer; "
        "move the code that needs it up a layer (docs/architecture.md, 'Layers')"
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_only_the_runtime_imports_torch(path: Path) -> None:
    module = module_name(path)
    if any(module == user or module.startswith(user + ".") for user in TORCH_USERS):
        return
    torch = sorted(name for name in imports_of(path) if name == "torch" or name.startswith("torch."))
    assert not torch, f"{module} imports {', '.join(torch)}: only pipec/runtime, pipec/torch.py and pipec/hf.py may"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_only_pipec_hf_imports_transformers(path: Path) -> None:
    module = module_name(path)
    if module in TRANSFORMERS_USERS:
        return
    found = sorted(name for name in imports_of(path) if name.split(".")[0] in ("transformers", "huggingface_hub"))
    assert not found, f"{module} imports {', '.join(found)}: only pipec/hf.py may (an optional extra)"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_only_the_command_line_knows_argparse(path: Path) -> None:
    module = module_name(path)
    if module == "pipec.cli" or module.startswith("pipec.cli."):
        return
    assert "argparse" not in imports_of(path), f"{module} imports argparse; parse arguments in pipec/cli/"


# Pairs (importer, imported) that the layers allow but the design does not. The front end produces what the passes
# consume and neither imports the other: the bounds both apply live in the leaf pipec.limits, and the driver,
# pipec.compiler, hands a `choose` section the list scheduler. The verifier checks programs, not the text they came
# from: a program carries its provenance (Program.op_spans).
SEPARATE = (("pipec.frontend", "pipec.passes"), ("pipec.passes", "pipec.frontend"), ("pipec.verify", "pipec.frontend"))


def imports_between(importer: str, imported: str, sources: dict[str, set[str]]) -> list[str]:
    """`module -> name` for each import from a module of package `importer` of a module of package `imported`."""
    def within(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    return sorted(
        f"{module} -> {name}"
        for module, names in sources.items()
        if within(module, importer)
        for name in names
        if within(name, imported)
    )


@pytest.mark.parametrize(("importer", "imported"), SEPARATE)
def test_packages_kept_apart(importer: str, imported: str) -> None:
    found = imports_between(importer, imported, {module_name(path): imports_of(path) for path in SOURCES})
    assert not found, f"{importer} must not import {imported}: {found}"


def test_packages_kept_apart_finds_a_late_import() -> None:
    source = "def _explain() -> None:\n    from pipec.frontend.expand import prepare\n"
    sources = {"pipec.verify.diagnose": imports_in(source, "pipec.verify.diagnose")}
    assert imports_between("pipec.verify", "pipec.frontend", sources) == [
        "pipec.verify.diagnose -> pipec.frontend.expand"
    ]


def test_the_ir_does_not_reach_up() -> None:
    """The cycle that motivated the rule: pipec/ir.py imports nothing of the verifier, not even in a function."""
    names = imports_of(PACKAGE / "ir.py")
    assert not [n for n in names if n.startswith(("pipec.verify", "pipec.passes", "pipec.sim"))], names
    assert layer_of("pipec.ir") < layer_of("pipec.passes.p2p") < layer_of("pipec.verify.deadlock")


@pytest.mark.parametrize(
    "late_import",
    ["from pipec.verify import verify", "import pipec.verify.memory", "from pipec import verify", "import torch"],
)
def test_the_layer_check_finds_an_upward_import_inside_a_function(late_import: str) -> None:
    source = (PACKAGE / "ir.py").read_text(encoding="utf-8") + f"\n\ndef _late() -> None:\n    {late_import}\n"
    names = imports_in(source, "pipec.ir")
    assert upward("pipec.ir", names) or "torch" in names


def test_import_pipec_loads_neither_the_verifier_nor_torch() -> None:
    """`import pipec` and `pipec compile` stay fast; `program.check()` imports the verifier when called."""
    code = (
        "import sys, pipec\n"
        "assert 'pipec.verify' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "program = pipec.compile('1f1b', 4, 8)\n"
        "assert program.check().ok and pipec.check(program, p2p='tagged').ok\n"
        "assert 'pipec.verify' in sys.modules and 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_program_check_raises_on_an_invalid_program() -> None:
    import pipec

    program = pipec.load("1f1b", 2, 2)
    broken = program.with_streams((program.streams[0][::-1], program.streams[1]), has_comms=False)
    with pytest.raises(pipec.ScheduleError):
        broken.check()
    with pytest.raises(pipec.ScheduleError):
        pipec.check(broken)


def import_graph(sources: dict[str, set[str]]) -> nx.DiGraph:
    """Module -> the pipec modules it imports (anywhere in it), over the modules given. A package's `__init__`
    counts when its names are imported (`from pipec.verify import verify`), not when a submodule is: the package
    facade that re-exports its submodules is not a circle, since no submodule needs the facade's names."""
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for module, names in sources.items():
        graph.add_edges_from((module, name) for name in names if name in sources and name != module)
    return graph


def package_of(module: str) -> str:
    """The room a module lives in: `pipec.verify.deadlock.nccl` -> `pipec.verify`, `pipec.ir` -> `pipec.ir`."""
    return ".".join(module.split(".")[:2])


def import_cycles(graph: nx.DiGraph) -> list[list[str]]:
    """Each import circle, as the sorted modules of one strongly connected component of more than one module."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def package_graph(graph: nx.DiGraph) -> nx.DiGraph:
    rooms = nx.DiGraph()
    rooms.add_nodes_from(package_of(m) for m in graph)
    rooms.add_edges_from((package_of(a), package_of(b)) for a, b in graph.edges if package_of(a) != package_of(b))
    return rooms


SOURCE_IMPORTS = {module_name(path): imports_of(path) for path in SOURCES}


def test_no_import_circle_between_modules() -> None:
    cycles = import_cycles(import_graph(SOURCE_IMPORTS))
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_import_circle_between_packages() -> None:
    """Rooms too: frontend -> passes -> frontend is a circle even when no single module closes it."""
    cycles = import_cycles(package_graph(import_graph(SOURCE_IMPORTS)))
    assert not cycles, "import circles between packages: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_circle_check_finds_a_circle_added_on_purpose() -> None:
    """A late import of the simulator from the IR closes ir -> ... -> sim -> ir: both checks see it."""
    sources = dict(SOURCE_IMPORTS)
    sources["pipec.ir"] = sources["pipec.ir"] | {"pipec.sim.costs"}
    assert any("pipec.ir" in c for c in import_cycles(import_graph(sources)))
    assert any("pipec.ir" in c for c in import_cycles(package_graph(import_graph(sources))))


# The rooms stay small (docs/architecture.md, "Sizes"): a module over 600 lines holds more than one idea, and a
# function over 120 lines more than one step. The exceptions are hot loops whose local-variable style is a measured
# choice, each named with the benchmark that measures it.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 120
HOT_LOOPS = {
    "pipec.sim.hosts.run_hosts": "bench/simulate.py, the nccl column",
    "pipec.verify.flat.flatten": "bench/check.py, the verify column",
}


def long_functions(path: Path) -> dict[str, int]:
    """Every function of a module (methods and nested ones too) longer than the limit: dotted name -> lines."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found[f"{module_name(path)}.{node.name}"] = lines
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_rooms_stay_small(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_MODULE_LINES, f"{module_name(path)} has {lines} lines: split it by responsibility"
    long = {name: n for name, n in long_functions(path).items() if name not in HOT_LOOPS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_hot_loops_named_exist_and_are_documented() -> None:
    architecture = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, bench in HOT_LOOPS.items():
        module, _, function = name.rpartition(".")
        path = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
        assert f"def {function}(" in path.read_text(encoding="utf-8"), f"{name} is gone: update HOT_LOOPS"
        assert f"`{module.removeprefix('pipec.').replace('.', '/')}.py` `{function}`" in architecture, name
        assert bench.split(",")[0] in architecture, bench
