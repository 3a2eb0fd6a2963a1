"""The layers import only downward: every import in every module (top-level or inside a function) is checked, and so
is every string that names a project module (`"fusion_model.cli.fit"`, `"data_shards.datamodule.FusionDataModule"`,
`"pkg.module:function"`), as importlib, a command table or a class path would import it.

    common (atomic files, checkpoint reads, threads, compatibility)         0
    tokenizer (vocabulary, image and video tokenizers)                       1
    data_shards (shards, stream, data module) | fusion_model.layers         2   (siblings: never import each other)
    fusion_model.config + fusion_model.blocks (the decoder's config, its blocks)   3
    fusion_model.model, .checkpoint, .hf_convert (the decoder, on disk, transformers)  4
    fusion_model.sampling (the one decode loop, text and images in and out)  5
    fusion_model.families (the protocol, the registry, one folder per family)  6
    fusion_model.training (Lightning module, callbacks, checkpoint IO)      7
    fusion_model.cli (every pipeline subcommand)                            8
    evaluation (the suites of `train.py eval`: checkers, figures, sample pages)  9
    experiments (the demo and the experiments, run from a checkout)         10

Besides the order: data_shards is wired to the model only by the command line (cli, evaluation, experiments); a family's folder
never imports another family's folder (what two families share moves down into the protocol or the shared layers);
the protocol modules (base, loading) import no family folder; training and cli import the families' registry and
protocol only, never a family's own modules (a family is chosen by name, through the registry).
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "tokenizer", "data_shards", "fusion_model", "evaluation", "experiments")
# a string that may name a project module, optionally with an attribute: `pkg.module`, `pkg.module.Class`,
# `pkg.module:function`
MODULE_STRING = re.compile(rf"^({'|'.join(PACKAGES)})(\.\w+)+(:\w+)?$")

# fusion_model's layers by the module's first part below the package
FUSION_RANKS = {"layers": (2, "layers"), "config": (3, "blocks"), "blocks": (3, "blocks"), "model": (4, "model"),
                "checkpoint": (4, "model"), "hf_convert": (4, "model"), "sampling": (5, "sampling"),
                "families": (6, "families"), "training": (7, "training"), "cli": (8, "cli")}
FAMILY_PROTOCOL = ("fusion_model.families", "fusion_model.families.base", "fusion_model.families.loading")


def layer_of(module: str) -> tuple[int, str]:
    """(rank, name) of the layer a dotted module name belongs to."""
    parts = module.split(".")
    top = {"common": (0, "common"), "tokenizer": (1, "tokenizer"), "data_shards": (2, "data_shards"),
           "evaluation": (9, "evaluation"), "experiments": (10, "experiments")}
    if parts[0] in top:
        return top[parts[0]]
    if parts[0] == "fusion_model":
        if len(parts) == 1:
            return 2, "layers"  # the package's own __init__ (a docstring): beneath everything in it
        if parts[1] in FUSION_RANKS:
            return FUSION_RANKS[parts[1]]
        raise ValueError(f"{module}: fusion_model.{parts[1]} has no layer; add it to FUSION_RANKS in this test")
    raise ValueError(f"{module} is not a project module")


def family_folder(module: str) -> str | None:
    """The family folder (`fusion_model.families.<name>`) a module belongs to, or None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["fusion_model", "families"] and (REPO.joinpath(*parts[:3]) / "__init__.py").is_file():
        return ".".join(parts[:3])
    return None


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when the import goes down (or sideways in one layer)."""
    (rank_a, name_a), (rank_b, name_b) = layer_of(importer), layer_of(imported)
    if rank_b > rank_a:
        return f"{importer} ({name_a}) imports {imported} from the higher layer {name_b}"
    if rank_a == rank_b and name_a != name_b:
        return f"{importer} ({name_a}) imports its sibling layer {name_b} ({imported})"
    if name_b == "data_shards" and name_a not in ("data_shards", "cli", "evaluation", "experiments"):
        return f"{importer} ({name_a}) imports {imported}: the data module is wired to the model by cli/, not imported"
    folder_a, folder_b = family_folder(importer), family_folder(imported)
    if folder_b is not None and folder_a not in (None, folder_b):
        return f"{importer} imports {imported} from its sibling family {folder_b}: move what they share down"
    if folder_b is not None and importer in FAMILY_PROTOCOL[1:]:
        return f"{importer} (the family protocol) imports the family {folder_b}: families sit above their protocol"
    if folder_b is not None and name_a in ("training", "cli"):
        return (f"{importer} ({name_a}) imports {imported}, a family's own module: choose families by name through "
                "fusion_model.families and call them through the Family protocol")
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


def all_modules(root: Path = REPO) -> list[Path]:
    """Every Python file of the project's packages."""
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))


def layering_problems(root: Path = REPO) -> list[str]:
    """Every import (or module-naming string) in the packages under `root` that goes against the layer order."""
    problems = []
    for path in all_modules(root):
        importer = module_name(path, root)
        for line, imported in project_imports(path, root) + named_modules(path, root):
            why = violation(importer, imported)
            if why:
                problems.append(f"{path.relative_to(root)}:{line}: {why}")
    return problems


def test_every_import_goes_down_the_layers():
    problems = layering_problems()
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_every_fusion_model_module_has_a_layer():
    for path in (REPO / "fusion_model").rglob("*.py"):
        layer_of(module_name(path))  # raises for a module no rank names


def test_the_check_catches_upward_and_sideways_imports():
    assert violation("tokenizer.vocab", "fusion_model.model")  # upward
    assert violation("common.files", "tokenizer.vocab")  # common is beneath every package
    assert violation("fusion_model.layers.norms", "fusion_model.config")  # layers take sizes, not the config
    assert violation("fusion_model.layers.attention", "fusion_model.blocks.mot")  # layers -> blocks
    assert violation("fusion_model.blocks.dense", "fusion_model.model")  # blocks -> model
    assert violation("fusion_model.model", "fusion_model.sampling.decode")  # model -> sampling
    assert violation("fusion_model.sampling.decode", "fusion_model.families.base")  # sampler -> families
    assert violation("fusion_model.model", "fusion_model.training.callbacks")  # model -> training
    assert violation("fusion_model.training.callbacks", "fusion_model.cli.fit")  # training -> cli
    assert violation("fusion_model.cli.fit", "experiments.demo.stages")  # cli -> experiments
    assert violation("data_shards.stream", "fusion_model.config")  # data_shards -> fusion_model
    assert violation("data_shards.stream", "fusion_model.layers.loss")  # siblings
    assert violation("fusion_model.sampling", "data_shards.stream")  # model layers -> data_shards
    assert violation("fusion_model.training.lightning_module", "data_shards.stream")
    assert violation("fusion_model.families.late.family", "fusion_model.families.chameleon.family")  # sibling family
    assert violation("fusion_model.families.base", "fusion_model.families.transfusion.layout")  # protocol -> family
    assert violation("fusion_model.cli.generate", "fusion_model.families.transfusion.sampling")  # cli -> a family
    assert violation("fusion_model.training.lightning_module", "fusion_model.families.chameleon")
    assert violation("fusion_model.cli.fit", "data_shards.datamodule") is None  # cli wires both
    assert violation("fusion_model.cli.generate", "fusion_model.families.loading") is None  # the protocol
    assert violation("fusion_model.families.transfusion.family", "fusion_model.families.base") is None
    assert violation("fusion_model.families.transfusion.family", "fusion_model.families.transfusion.unet") is None
    assert violation("fusion_model.families.late.model", "fusion_model.model") is None
    assert violation("experiments.demo.stages", "common.files") is None
    assert violation("fusion_model.training.callbacks", "fusion_model.sampling.generate") is None


def test_an_injected_upward_import_inside_fusion_model_fails_the_check(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert layering_problems(tmp_path) == []
    norms = tmp_path / "fusion_model" / "layers" / "norms.py"
    norms.write_text(norms.read_text() + "\n\ndef _late():\n    from fusion_model.families import base  # noqa\n")
    sampler = tmp_path / "fusion_model" / "sampling" / "decode.py"
    sampler.write_text(sampler.read_text() + '\nFAMILY = "fusion_model.families.transfusion.sampling:generate"\n')
    problems = layering_problems(tmp_path)
    assert len(problems) == 2
    assert "fusion_model/layers/norms.py" in problems[0] and "higher layer families" in problems[0]
    assert "fusion_model/sampling/decode.py" in problems[1] and "higher layer families" in problems[1]


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
    demo = tmp_path / "experiments" / "demo"
    demo.mkdir(parents=True)
    package.mkdir()
    (package / "__init__.py").write_text("")
    (tmp_path / "experiments" / "__init__.py").write_text("")
    (demo / "__init__.py").write_text("")
    (demo / "pipeline.py").write_text("")
    (package / "model.py").write_text("")
    (package / "cli.py").write_text(
        'TABLE = {"demo": ("experiments.demo.pipeline", "run it")}\n'
        'def f():\n    return ["fusion_model.model.FusionModel", "experiments.demo:main", "experiments.demo.pipeline:run"]\n'
        'FILES = ["tokenizer.json", "fusion_model.missing", "see experiments.demo", "experiments.demo.pipeline "]\n'
    )
    found = sorted(named_modules(package / "cli.py", root=tmp_path))
    assert found == [(1, "experiments.demo.pipeline"), (3, "experiments.demo"), (3, "experiments.demo.pipeline"),
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
