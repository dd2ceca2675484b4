"""The package's shape: no import cycles, one door per concept, the emulation
harness stands alone, modules stay small, no package folder and no tracked
folder at any depth has a name that a common .gitignore ignores, and every
document the project cites is in the repository."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dflash_mlx"
# source folders and the package names they install as (pyproject's package-dir)
SOURCES = {ROOT / "dflash_mlx": PACKAGE, ROOT / "convert": f"{PACKAGE}.convert"}
MAX_LINES = 450


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module the package installs."""
    found = {}
    for folder, name in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its file
    (function-level imports included: a lazy import is still a dependency)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def resolve(dotted: str) -> None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted:
            found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                resolve(target if target in known else base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]):
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_imports_resolve_to_modules(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from . import x\nfrom .y import f\nfrom .. import z\nimport p.q.r\n")
    known = {"p.q", "p.q.x", "p.q.y", "p.z", "p"}
    assert imports("p.q.m", path, known) == {"p.q.x", "p.q.y", "p.z", "p.q"}


def test_no_import_cycles():
    graph = import_graph()
    assert f"{PACKAGE}.kernels.registry" in graph and f"{PACKAGE}.convert" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_emulation_harness_imports_nothing_of_the_package():
    graph = import_graph()
    harness = [m for m in graph if m == f"{PACKAGE}.emulate" or m.startswith(f"{PACKAGE}.emulate.")]
    assert harness
    for module in harness:
        assert not {m for m in graph[module] if not m.startswith(f"{PACKAGE}.emulate")}, module


def test_the_acceptance_rules_import_nothing_of_the_package():
    assert import_graph()[f"{PACKAGE}.loop.acceptance"] == set()


def test_kernels_know_no_models():
    """Kernels take and return arrays: nothing under kernels/ imports the draft,
    the target or mlx.nn (model surgery belongs with the models)."""
    for name, path in modules().items():
        if name.startswith(f"{PACKAGE}.kernels"):
            source = path.read_text()
            assert "mlx.nn" not in source, name
            deps = import_graph()[name]
            allowed = {m for m in deps if m.startswith(f"{PACKAGE}.kernels")}
            allowed |= {f"{PACKAGE}.emulate", f"{PACKAGE}.loop.acceptance"}
            assert deps <= allowed, f"{name} imports {sorted(deps - allowed)}"


def door_modules(package: str) -> set[str]:
    """The modules a subpackage's ``__init__`` names in ``__all__`` (the loop's
    ``acceptance`` and ``cost_curve``): others may import them as modules."""
    for node in ast.parse(modules()[package].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {f"{package}.{name}" for name in ast.literal_eval(node.value)} & set(modules())
    return set()


@pytest.mark.parametrize("folder", ["loop", "draft", "targets", "tree"])
def test_each_concept_has_one_door(folder):
    """Modules outside loop/, draft/, targets/ and tree/ import only the
    subpackage itself (what its ``__init__`` names), never one of its modules
    but those the ``__init__`` names as modules."""
    package = f"{PACKAGE}.{folder}"
    inside = {m for m in modules() if m.startswith(f"{package}.")} - door_modules(package)
    assert inside, package
    reaching_in = [
        f"{name} imports {sorted(deps & inside)}"
        for name, deps in import_graph().items()
        if name != package and not name.startswith(f"{package}.") and deps & inside
    ]
    assert not reaching_in, "\n".join(reaching_in)


def test_the_door_rule_sees_a_module_reaching_in(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from ..draft.cache import DraftContextCache\nfrom ..draft import DFlashDraft\n")
    known = {"p", "p.draft", "p.draft.cache", "p.x.m"}
    assert imports("p.x.m", path, known) == {"p.draft.cache", "p.draft"}


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_stay_small(name):
    lines = modules()[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines (limit {MAX_LINES}): split it along its concerns"


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = [ROOT / f for f in out.stdout.split() if f.endswith((".py", ".md", ".metal", ".h", ".toml"))]
    return [f for f in files if f.exists()]


def test_every_cited_document_is_in_the_repository():
    missing = []
    for path in tracked_text_files():
        for cited in re.findall(r"[\w./-]*[\w-]\.md\b", path.read_text(errors="replace")):
            if not ((ROOT / cited).exists() or (path.parent / cited).exists()):
                missing.append(f"{path.relative_to(ROOT)} cites {cited}")
    assert not missing, "\n".join(missing)


# Folder names that GitHub's standard .gitignore templates ignore wherever they
# occur (build output, downloaded dependencies, environments), with the
# templates that ignore each. A package folder, or any folder holding tracked
# files (the demo pair's weights included), with one of these names is silently
# left out of the commits of a contributor who uses the template.
IGNORED_BY_TEMPLATES = {
    "target": "Python (PyBuilder), Rust (Cargo) and Java (Maven)",
    "build": "Python (distribution / packaging)",
    "dist": "Python and Node",
    "out": "Node (Next.js) and Java IDEs (IntelliJ)",
    "bin": "Java IDEs (Eclipse)",
    "debug": "Rust (Cargo)",
    "lib": "Python (distribution / packaging)",
    "lib64": "Python (distribution / packaging)",
    "parts": "Python (distribution / packaging)",
    "sdist": "Python (distribution / packaging)",
    "var": "Python (distribution / packaging)",
    "wheels": "Python (distribution / packaging)",
    "eggs": "Python (distribution / packaging)",
    "develop-eggs": "Python (distribution / packaging)",
    "downloads": "Python (distribution / packaging)",
    ".eggs": "Python (distribution / packaging)",
    "env": "Python (distribution / packaging, and ENV/ for virtualenv)",
    "venv": "Python (virtualenv)",
    ".venv": "Python (virtualenv)",
    "node_modules": "Node (dependency directories)",
}


def package_folders() -> list[Path]:
    """Every folder of the package's sources that holds a module, and every
    top-level folder of the repository that holds a tracked file."""
    folders = {path.parent for folder in SOURCES for path in folder.rglob("*.py")}
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0:
        folders |= {ROOT / Path(f).parts[0] for f in out.stdout.splitlines() if len(Path(f).parts) > 1}
    return sorted(folders)


def ignored_folders(folders: list[Path]) -> list[str]:
    """Folders (and folders above them, up to the repository) whose name a
    template ignores; compared without case, as git does on macOS."""
    found = []
    for folder in folders:
        for part in folder.relative_to(ROOT).parts:
            if part.lower() in IGNORED_BY_TEMPLATES:
                found.append(f"{folder.relative_to(ROOT)}: '{part}/' is ignored by GitHub's "
                             f"{IGNORED_BY_TEMPLATES[part.lower()]} .gitignore template")
                break
    return found


def test_no_package_folder_is_ignored_by_a_common_gitignore_template():
    folders = package_folders()
    assert ROOT / PACKAGE / "draft" in folders and ROOT / "convert" in folders and ROOT / "docs" in folders
    ignored = ignored_folders(folders)
    assert not ignored, "rename the folder:\n" + "\n".join(ignored)


def folders_of(files: list[str]) -> list[Path]:
    """Every folder, at any depth, that holds one of ``files`` (paths relative
    to the repository), directly or below it."""
    return sorted({ROOT / parent for f in files for parent in Path(f).parents if parent != Path(".")})


def tracked_folders() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return folders_of([f for f in out.stdout.split("\0") if f])


def test_no_tracked_folder_is_ignored_by_a_common_gitignore_template():
    """Every folder that holds a tracked file, at any depth, data folders
    included: a new file put there (a rebuilt demo pair's weights) would
    otherwise be silently left out of a contributor's commits."""
    folders = tracked_folders()
    assert ROOT / PACKAGE / "demo_pair" / "draft" in folders and ROOT / ".ci" in folders
    ignored = ignored_folders(folders)
    assert not ignored, "rename the folder:\n" + "\n".join(ignored)


def test_the_tracked_folder_check_sees_a_nested_data_folder():
    """The demo pair's target once lived in demo_pair/target/, which holds no
    module and is no top-level folder: the check sees it."""
    folders = folders_of(["README.md", f"{PACKAGE}/demo_pair/target/config.json", f"{PACKAGE}/demo_pair/draft/x.json"])
    assert folders == [ROOT / PACKAGE, ROOT / PACKAGE / "demo_pair", ROOT / PACKAGE / "demo_pair" / "draft",
                       ROOT / PACKAGE / "demo_pair" / "target"]
    assert ignored_folders(folders) == [
        f"{PACKAGE}/demo_pair/target: 'target/' is ignored by GitHub's "
        f"{IGNORED_BY_TEMPLATES['target']} .gitignore template",
    ]


def test_the_template_check_sees_a_target_folder():
    assert ignored_folders([ROOT / PACKAGE / "target", ROOT / PACKAGE / "targets", ROOT / "Build" / "x"]) == [
        f"{PACKAGE}/target: 'target/' is ignored by GitHub's {IGNORED_BY_TEMPLATES['target']} .gitignore template",
        f"Build/x: 'Build/' is ignored by GitHub's {IGNORED_BY_TEMPLATES['build']} .gitignore template",
    ]


def test_the_repository_ignores_none_of_its_tracked_files():
    """The repository's own .gitignore files ignore nothing it tracks (a new
    file beside a tracked one would be left out of commits)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--ignored", "--exclude-per-directory=.gitignore"],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    assert not out.stdout.strip(), out.stdout
