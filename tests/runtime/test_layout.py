"""The module layout (#32): no import cycles, kernels as leaves, one executor interface.

- The import graph of the contract `spec_schema`, `spec_runtime`, the kernels `spec_kernels` and the
  trainer `spec_train` (function-level imports included) has no cycle. `from package import module`
  is an edge to the module, not to the package's `__init__` (which a module of the package does
  not run a second time).
- The trainer is a consumer of the runtime: no runtime module imports it, except `cli`'s `train`
  subcommand inside a function.
- `spec_kernels` is a leaf library: no module of it imports `spec_runtime` or `spec_train`.
- The phases reach the executor only through `executor.Executor`: the methods they (and the engine)
  call on `rt.runner` are exactly the protocol's, and every executor class has each of them with the
  protocol's parameters.
- Every module of the runtime core imports on CPU (moved GPU-only code fails here, not on the GPU).
"""

import ast
import collections
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import spec_kernels
import spec_runtime
import spec_schema
import spec_train
from spec_runtime.executor import EXECUTOR_METHODS, Executor

SRC = Path(spec_runtime.__file__).parent
PACKAGES = {"spec_schema": Path(spec_schema.__file__).parent, "spec_runtime": SRC,
            "spec_kernels": Path(spec_kernels.__file__).parent, "spec_train": Path(spec_train.__file__).parent}


def _modules() -> dict[str, Path]:
    mods = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = (package,) + path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _import_graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """module -> the modules of `PACKAGES` it imports anywhere in its body, or outside function bodies
    with `top_level_only` (`from a import b` counts a.b when b is a module, else a)."""
    mods = _modules()
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in _import_nodes(ast.parse(path.read_text()), top_level_only):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                names = subs if len(subs) == len(node.names) else [target] + subs
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            edges[name] |= {m for m in names if m in mods and m != name}
    return edges


def _import_nodes(tree: ast.AST, top_level_only: bool) -> list[ast.AST]:
    """The nodes of `tree`, without those inside function bodies when `top_level_only`."""
    if not top_level_only:
        return list(ast.walk(tree))
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(c for c in ast.iter_child_nodes(node)
                    if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    return out


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, f"import cycles in {', '.join(PACKAGES)}: {[sorted(c) for c in cycles]}"


def test_cycle_finder_finds_a_planted_cycle() -> None:
    edges = _import_graph()
    edges["spec_runtime.tree.accept"].add("spec_runtime.verify")  # the import #32 removed
    assert any("spec_runtime.verify" in c for c in _cycles(edges))
    edges = _import_graph()  # and the contract's former circles, through function-level imports
    edges["spec_schema.config"].add("spec_schema.model_dirs")
    edges["spec_schema.engines._sglang_install"].add("spec_schema.engines.sglang")
    for pair in ({"spec_schema.config", "spec_schema.model_dirs"},
                 {"spec_schema.engines._sglang_install", "spec_schema.engines.sglang"}):
        assert any(pair <= c for c in _cycles(edges)), pair


def _runtime_imports_of_the_trainer(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    return {m: sorted(t for t in targets if t.split(".")[0] == "spec_train")
            for m, targets in edges.items() if m.split(".")[0] == "spec_runtime"
            and any(t.split(".")[0] == "spec_train" for t in targets)}


def test_the_runtime_imports_the_trainer_only_in_the_train_command() -> None:
    top = _import_graph(top_level_only=True)
    assert _runtime_imports_of_the_trainer(top) == {}
    anywhere = _runtime_imports_of_the_trainer(_import_graph())
    assert anywhere == {"spec_runtime.cli": ["spec_train.cli"]}, anywhere
    # the check can fail: the old `from .train.cli import ...` in the parser, and function-level
    # imports that top_level_only leaves out (spec_train.evaluate's import of the engine)
    assert "spec_runtime.engine" in _import_graph()["spec_train.evaluate"]
    assert "spec_runtime.engine" not in top["spec_train.evaluate"]
    top["spec_runtime.cli"].add("spec_train.cli")
    assert _runtime_imports_of_the_trainer(top) == {"spec_runtime.cli": ["spec_train.cli"]}


def _kernel_imports_above(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    return {m: sorted(t for t in targets if t.split(".")[0] != "spec_kernels")
            for m, targets in edges.items() if m.split(".")[0] == "spec_kernels"
            and any(t.split(".")[0] != "spec_kernels" for t in targets)}


def test_the_kernels_are_a_leaf_library() -> None:
    edges = _import_graph()
    assert len([m for m in edges if m.startswith("spec_kernels.")]) >= 10
    assert _kernel_imports_above(edges) == {}
    # the check can fail: the imports the package split removed (the tree's references, the KV cache)
    edges["spec_kernels.accept"].add("spec_runtime.tree")
    edges["spec_kernels.kv_store"].add("spec_runtime.kv_cache")
    assert _kernel_imports_above(edges) == {"spec_kernels.accept": ["spec_runtime.tree"],
                                            "spec_kernels.kv_store": ["spec_runtime.kv_cache"]}


def _runner_calls(path: Path) -> set[str]:
    """Names X of every `<...>.runner.X` in a module."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "runner":
            calls.add(node.attr)
    return calls


def test_phases_call_exactly_the_executor_protocol() -> None:
    called = set().union(*(_runner_calls(SRC / f) for f in ("draft.py", "verify.py", "extend.py", "engine.py")))
    assert called == set(EXECUTOR_METHODS), (
        f"called but not in Executor: {sorted(called - set(EXECUTOR_METHODS))}; "
        f"in Executor but never called: {sorted(set(EXECUTOR_METHODS) - called)}")


def _executor_classes() -> list[type]:
    from spec_runtime.executors.eager import EagerExecutor
    from spec_runtime.executors.static import GraphRunner

    return [EagerExecutor, GraphRunner]


@pytest.mark.parametrize("cls", _executor_classes(), ids=lambda c: c.__name__)
def test_executors_satisfy_the_protocol(cls: type) -> None:
    for name in EXECUTOR_METHODS:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks Executor.{name}"
        want = list(inspect.signature(getattr(Executor, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name} takes {got}, Executor.{name} takes {want}"


def test_runtimes_hold_an_executor(load_pair, llama_dir, standalone_dir) -> None:
    from spec_runtime.runtime import Runtime

    target, draft = load_pair("STANDALONE", llama_dir, standalone_dir)
    for executor in ("eager", "static"):
        rt = Runtime.create(target, draft, "STANDALONE", num_steps=2, topk=2, num_draft_tokens=4,
                            max_batch_size=2, max_context=32, executor=executor)
        assert isinstance(rt.runner, Executor), executor


def test_every_core_module_imports() -> None:
    for pkg in ("spec_runtime.executors", "spec_runtime.tree", "spec_runtime.buffers"):
        for info in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + "."):
            importlib.import_module(info.name)
    for name in ("core_types", "executor", "state", "runtime", "draft", "verify", "extend", "engine"):
        importlib.import_module(f"spec_runtime.{name}")
    for name in ("inputs", "accept", "bookkeeping", "tuning", "tuning_file"):
        importlib.import_module(f"spec_kernels.{name}")


def test_importing_the_runtime_imports_no_triton_and_no_launcher() -> None:
    """CPU users never pay triton's import, and no kernel module is loaded (and its interpreter shims
    set up) before a test or a user has chosen TRITON_INTERPRET: the runtime reaches the kernels'
    package only through `spec_kernels.inputs` until a fast path is built."""
    import subprocess
    import sys

    code = ("import sys, spec_runtime.engine, spec_runtime.runtime, spec_runtime.cli; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('spec_kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['spec_kernels', 'spec_kernels.inputs']"
