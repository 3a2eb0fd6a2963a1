"""The layers import only downward: every import in every module (top-level or inside a function) is checked, and so
is every string that names a project module (`"fusion_model.cli.fit"`, `"data_shards.datamodule.FusionDataModule"`,
`"pkg.module:function"`), as importlib, a command table or a class path would import it.

    tokenizer (vocabulary, image tokenizer, file rules, compatibility)      0
    data_shards (shards, stream, data module) | fusion_model model layer    1   (siblings: never import each other)
    fusion_model.training (Lightning module, callbacks, checkpoint IO)      2
    fusion_model.cli (every train.py subcommand)                           3
    fusion_model.demo (the end-to-end demo)                                 4
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "tokenizer", "data_shards", "fusion_model")
# a string that may name a project module, optionally with an attribute: `pkg.module`, `pkg.module.Class`,
# `pkg.module:function`
MODULE_STRING = re.compile(rf"^({'|'.join(PACKAGES)})(\.\w+)+(:\w+)?$")


def layer_of(module: str) -> tuple[int, str]:
    """(rank, name) of the layer a dotted module name belongs to."""
    parts = module.split(".")
    if parts[0] == "common":
        return -1, "common"
    if parts[0] == "tokenizer":
        return 0, "tokenizer"
    if parts[0] == "data_shards":
        return 1, "data_shards"
    if parts[0] == "fusion_model":
        sub = parts[1] if len(parts) > 1 else ""
        return {"training": (2, "training"), "cli": (3, "cli"), "demo": (4, "demo")}.get(sub, (1, "model"))
    raise ValueError(f"{module} is not a project module")


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when the import goes down (or sideways in one layer)."""
    (rank_a, name_a), (rank_b, name_b) = layer_of(importer), layer_of(imported)
    if rank_b > rank_a:
        return f"{importer} ({name_a}) imports {imported} from the higher layer {name_b}"
    if rank_a == rank_b and name_a != name_b:
        return f"{importer} ({name_a}) imports its sibling layer {name_b} ({imported})"
    if name_a == "training" and name_b == "data_shards":
        return f"{importer} (training) imports {imported}: the data module belongs to data_shards, wired in by cli/"
    return None


def module_name(path: Path, root: Path = REPO) -> str:
    """Dotted module name of a file under `root`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, module) for every import of a project package in the file, including relative and lazy ones."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from fusion_model import cli` / `from fusion_model.training import callbacks` import sub-modules
            names = [f"{base}.{alias.name}" if _is_module(root, f"{base}.{alias.name}") else base for alias in node.names]
        found += [(node.lineno, name) for name in names if name.split(".")[0] in PACKAGES]
    return found


def named_modules(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, module) for every string constant in the file that names a project module: the whole string (less a
    `:attribute`) when it is a module, else the string less its last part (`module.Class`) when that is a module
    below a top-level package (so a file name such as "tokenizer.json" names nothing)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value)):
            continue
        dotted = node.value.split(":")[0]
        parent = dotted.rsplit(".", 1)[0]
        if _is_module(root, dotted):
            found.append((node.lineno, dotted))
        elif "." in parent and _is_module(root, parent):
            found.append((node.lineno, parent))
    return found


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def all_modules() -> list[Path]:
    """Every Python file of the three packages."""
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_every_import_goes_down_the_layers():
    problems = []
    for path in all_modules():
        importer = module_name(path)
        for line, imported in project_imports(path) + named_modules(path):
            why = violation(importer, imported)
            if why:
                problems.append(f"{path.relative_to(REPO)}:{line}: {why}")
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_the_check_catches_upward_and_sideways_imports():
    assert violation("tokenizer.vocab", "fusion_model.model")  # upward
    assert violation("fusion_model.model", "fusion_model.training.callbacks")  # model -> training
    assert violation("fusion_model.training.callbacks", "fusion_model.cli.fit")  # training -> cli
    assert violation("fusion_model.cli.fit", "fusion_model.demo.stages")  # cli -> demo
    assert violation("data_shards.stream", "fusion_model.config")  # data_shards -> fusion_model
    assert violation("fusion_model.sampling", "data_shards.stream")  # model -> data_shards
    assert violation("fusion_model.training.lightning_module", "data_shards.stream")
    assert violation("fusion_model.cli.fit", "data_shards.datamodule") is None  # cli wires both
    assert violation("fusion_model.demo.stages", "common.files") is None
    assert violation("fusion_model.training.callbacks", "fusion_model.generation") is None


def test_the_import_walker_sees_lazy_relative_and_package_imports(tmp_path):
    package = tmp_path / "fusion_model"
    (package / "training").mkdir(parents=True)
    (package / "cli.py").write_text("")
    (package / "training" / "callbacks.py").write_text("")
    (package / "model.py").write_text(
        "from fusion_model import cli\n"
        "def f():\n    from .training import callbacks\n    import data_shards.stream\n"
    )
    found = [name for _, name in project_imports(package / "model.py", root=tmp_path)]
    assert found == ["fusion_model.cli", "fusion_model.training.callbacks", "data_shards.stream"]


def test_the_string_walker_sees_module_names_and_class_paths_but_not_file_names(tmp_path):
    package = tmp_path / "fusion_model"
    (package / "demo").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "demo" / "__init__.py").write_text("")
    (package / "demo" / "pipeline.py").write_text("")
    (package / "model.py").write_text("")
    (package / "cli.py").write_text(
        'TABLE = {"demo": ("fusion_model.demo.pipeline", "run it")}\n'
        'def f():\n    return ["fusion_model.model.FusionModel", "fusion_model.demo:main", "fusion_model.demo.pipeline:run"]\n'
        'FILES = ["tokenizer.json", "fusion_model.missing", "see fusion_model.demo", "fusion_model.demo.pipeline "]\n'
    )
    found = sorted(named_modules(package / "cli.py", root=tmp_path))
    assert found == [(1, "fusion_model.demo.pipeline"), (3, "fusion_model.demo"), (3, "fusion_model.demo.pipeline"),
                     (3, "fusion_model.model")]
    assert violation("fusion_model.cli", found[0][1])  # a lower layer naming a higher one is caught


def test_no_import_cycles_between_modules():
    # imports only: a module named by a string is imported when it is used (importlib), not when its namer loads
    graph = {module_name(p): {name for _, name in project_imports(p)} for p in all_modules()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if imported == module or imported not in graph:
                continue
            if state.get(imported) == 1:
                cycles.append(" -> ".join([*path[path.index(imported):], imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_has_a_docstring(package):
    missing = [str(p.relative_to(REPO)) for p in (REPO / package).rglob("*.py")
               if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, f"modules without a one-line docstring: {missing}"
