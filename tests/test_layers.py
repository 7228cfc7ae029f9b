"""The layers import one way (DESIGN.md §2): ir → kernels → ops → passes → compiler → runtime → meshc.

Reads every module's imports from its source (AST: top-level and inside functions alike, lazily or not)
and fails on an import of a higher layer, and on any cycle between modules. No exception list.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"meshc": "meshc", "compiler": "meshc.compiler", "passes": "meshc.passes", "kernels": "meshc.kernels",
           "runtime": "meshc.runtime"}  # as pyproject maps them
# (layer, module-name prefixes), lowest first; the first matching prefix decides, most specific listed first
LAYERS = [
    ("ir", ("meshc.compiler.ir",)),
    ("kernels", ("meshc.kernels",)),
    ("ops", ("meshc.runtime.ops",)),
    ("passes", ("meshc.passes",)),
    ("compiler", ("meshc.compiler",)),
    ("runtime", ("meshc.runtime",)),
    ("meshc", ("meshc",)),
]
ORDER = {name: i for i, (name, _) in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def layer_of(module: str) -> str:
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise AssertionError(f"{module}: in no layer; add it to LAYERS")


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """meshc modules `module` imports, resolved to the most specific module that exists."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_every_module_has_a_layer():
    for module in _modules():
        layer_of(module)


def test_imports_run_one_way():
    bad = [f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)})"
           for m, targets in sorted(_graph().items()) for t in sorted(targets)
           if ORDER[layer_of(t)] > ORDER[layer_of(m)]]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def folder_of(path: Path) -> str:
    """The folder a module lives in, sub-packages apart (compiler/cost, runtime/zero, ...): the rooms of the house."""
    return path.parent.relative_to(ROOT).as_posix()


def folder_cycles(graph: dict[str, set[str]], folder: dict[str, str]) -> list[str]:
    """Pairs of folders that import each other, directly or through others: "a <-> b"."""
    edges = {f: set() for f in folder.values()}
    for m, targets in graph.items():
        edges[folder[m]] |= {folder[t] for t in targets} - {folder[m]}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for t in edges[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        return seen
    reachable = {f: reach(f) for f in edges}
    return sorted(f"{a} <-> {b}" for a in edges for b in reachable[a] if a < b and a in reachable[b])


def test_no_cycles_between_folders():
    """The folders, every sub-package its own (compiler/ir, compiler/cost, runtime/ops, ...), import one way too:
    a module placed in the wrong folder (the compat shim in compiler/ rather than compiler/ir, a formatting helper
    in report/ that the cost model needs) shows up here."""
    known = _modules()
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    cycles = folder_cycles(graph, {m: folder_of(p) for m, p in known.items()})
    assert not cycles, "folders that import each other:\n" + "\n".join(cycles)


def test_the_folder_check_sees_a_cycle():
    """The check above can fail: a shim in compiler/ that passes and compiler both import is a cycle."""
    graph = {"meshc.compiler.shim": set(), "meshc.passes.p": {"meshc.compiler.shim"},
             "meshc.compiler.driver": {"meshc.passes.p"}, "meshc.compiler.ir.plan": set()}
    folder = {"meshc.compiler.shim": "compiler", "meshc.passes.p": "passes", "meshc.compiler.driver": "compiler",
              "meshc.compiler.ir.plan": "compiler/ir"}
    assert folder_cycles(graph, folder) == ["compiler <-> passes"]
    folder["meshc.compiler.shim"] = "compiler/ir"
    assert folder_cycles(graph, folder) == []


def test_no_folder_holds_more_than_20_modules():
    counts = {}
    for path in _modules().values():
        counts[path.parent.relative_to(ROOT).as_posix()] = counts.get(path.parent.relative_to(ROOT).as_posix(), 0) \
            + (path.name != "__init__.py")
    assert {f: n for f, n in counts.items() if n > 20} == {}


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The test above can fail: an import of the runtime from a pass is reported."""
    fake = tmp_path / "passes"
    fake.mkdir()
    (fake / "bad.py").write_text("from meshc.runtime.mesh import Mesh\nfrom . import good\n")
    (fake / "good.py").write_text("from .bad import x\n")
    known = {**_modules(), "meshc.passes.bad": fake / "bad.py", "meshc.passes.good": fake / "good.py"}
    assert _imports("meshc.passes.bad", fake / "bad.py", known) == {"meshc.runtime.mesh", "meshc.passes.good"}
    assert ORDER[layer_of("meshc.runtime.mesh")] > ORDER[layer_of("meshc.passes.bad")]


# Private names of torch objects that meshc's code reaches (op overloads, nn.Module and Tensor internals, private
# submodules and classes), flagged as attributes of anything but `self` (a meshc class's own `_buffers`, say, is
# not torch's) and as names imported from a torch module. meshc's own private attributes (ShardedParam's `_local`
# and `_spec`, ...) are not on the list; neither are ATen ops whose names start with "_" (aten._to_copy).
TORCH_PRIVATE = {
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_forward_hooks", "_forward_pre_hooks",
    "_backward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks", "_named_members", "_get_name",
    "_opname", "_schema", "_overloadpacket", "_C", "_dynamo", "_inductor", "_subclasses", "_pytree", "_functorch",
    "_export", "_guards", "_prims", "_refs", "_decomp", "_higher_order_ops", "_python_dispatch", "_internal",
    "_execution_engine", "_c10d_functional", "_make_wrapper_subclass", "_disabled_torch_function_impl",
    "_resolve_process_group", "_StorageInfo", "_orig_mod", "_cdata", "_base", "_version", "_typed_storage",
}


def private_torch_uses(path: Path) -> list[str]:
    """Each use of a private torch module, import or attribute in the file at `path`, as "file:line: what"."""
    where = os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else str(path)
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
            if node.module.split(".")[0] == "torch":
                bad += [f"{where}:{node.lineno}: imports {a.name} from {node.module}"
                        for a in node.names if a.name in TORCH_PRIVATE]
        if any(n.startswith("torch.") and any(p.startswith("_") for p in n.split(".")[1:]) for n in names):
            bad.append(f"{where}:{node.lineno}: imports {names[0]}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            bad.append(f"{where}:{node.lineno}: torch.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in TORCH_PRIVATE \
                and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            bad.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in TORCH_PRIVATE:
            bad.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_private_torch_only_in_the_compat_shim():
    """`torch._*` modules and private attributes of torch objects are reached through compiler/ir/torch_compat.py."""
    bad = [use for module, path in sorted(_modules().items()) if module != "meshc.compiler.ir.torch_compat"
           for use in private_torch_uses(path)]
    assert not bad, "private torch API outside the compat shim:\n" + "\n".join(bad)


def test_the_private_torch_check_sees_a_violation(tmp_path):
    fake = tmp_path / "bad.py"
    fake.write_text("import torch\nfrom torch.distributed.checkpoint.filesystem import _StorageInfo\n"
                    "def f(module, func, job):\n"
                    "    module._parameters['w'] = torch._C._nn\n"
                    "    return func._schema, getattr(module, '_buffers'), job._local, self._buffers\n")
    found = private_torch_uses(fake)
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports _StorageInfo from torch.distributed.checkpoint.filesystem", "module._parameters", "torch._C",
        "func._schema", "getattr(module, '_buffers')"], found
