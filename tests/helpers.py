"""Small helpers shared by test modules of several folders."""

import importlib.util
import types
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

KERNEL_LOOP = {"frontier": "triton", "fuse": False, "attention": "dense", "elementwise": "torch", "linear": "torch",
               "tree": "torch", "topk": "torch", "bookkeeping": "torch"}
"""`FastOptions` of the static executor with the draft's frontier kernels and every other piece on torch
(the CPU defaults, pinned so that a CUDA run compares the draft loop alone, not also the fused weights
and Triton layers); `{**KERNEL_LOOP, "topk": "triton"}` adds the Triton top-k."""


UNTIMED = {"linear": "gemv", "epilogues": "fused"}
"""`FastOptions` fields for GPU tests in float32: the Triton GEMV on every linear with every epilogue fused,
nothing timed at setup. No tuning file holds float32 decisions, and timing them from a cold Triton cache
compiles every candidate configuration of every shape and row bucket: on the H200 the real model's
float32 test spent all of a 420 s run there, before its first token."""


def load_script(name: str) -> types.ModuleType:
    """The module of `scripts/<name>.py` (scripts are files, not an importable package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_seen_at(output: list[int], start: int) -> int:
    """A token of `output` whose first occurrence is at index >= `start`: as a stop token, it ends
    the request mid-run, inside a verify, not at the prefill."""
    for j in range(start, len(output)):
        if output[j] not in output[:j]:
            return output[j]
    raise AssertionError(f"no token first seen at index >= {start} in {output}")


def drop_generated(cache, rows, lens) -> None:
    """Undo a `DecodeRunner.generate` on the slot table: free the slots each of `rows` took past its
    committed length `lens[i]` and clear those entries, so the same generation can run again."""
    for r, n in zip(rows.tolist(), lens.tolist()):
        row = cache.req_to_token[r]
        cache.free_slots(row[n:][row[n:] >= 0])
        row[n:] = -1


def rehearse_graph_functions(monkeypatch) -> None:
    """Make every `GraphSet.run` call its graph function twice more before the real call, as a CUDA
    capture's two warm-up runs do on live buffers (a graph captured on first use): on the static
    executor, a graph function that does not leave the same state however often it runs then
    changes the outputs."""
    from spec_runtime.executors.graphs import GraphSet

    real_run = GraphSet.run

    def rehearsed(self, key, fn):
        fn()
        fn()
        return real_run(self, key, fn)

    monkeypatch.setattr(GraphSet, "run", rehearsed)


def emulate_graph_pool(monkeypatch) -> None:
    """Give the static executor's `GraphSet` the semantics of CUDA graphs in one shared memory pool,
    on the CPU, so code that is only wrong on a GPU fails here too:

    - the runners capture on padding before the first step as on CUDA (`GraphRunner._capture_all`,
      `DecodeRunner.capture`), and a capture
      runs its function twice (warm-up), once more (the capture: its outputs become the graph's
      fixed outputs) and once again (the upload replay), each on the live buffers;
    - a replay runs the function and writes its results into the graph's fixed outputs, so an
      output kept across the graph's next replay changes as it would on the GPU;
    - a replay of graph A also overwrites the outputs of every graph captured after A (with NaN, a
      huge integer or flipped booleans): a later capture may place its outputs in pool memory that
      A's intermediates use. Only tensors the function allocated are treated so, not views of
      buffers that outlive it. Code must clone a graph's outputs before an earlier graph replays."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from spec_runtime.executors.decode import DecodeRunner
    from spec_runtime.executors.graphs import GraphSet, _Graph, tensors_in
    from spec_runtime.executors.static import GraphRunner

    class Births(TorchDispatchMode):
        """Storages of the tensors ops allocate (outputs whose storage is none of the op's inputs')."""

        def __init__(self) -> None:
            super().__init__()
            self.born: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {storage(t) for t in tensors_in([list(args), kwargs or {}])}
            self.born.update(storage(t) for t in tensors_in([out]) if storage(t) not in inputs)
            return out

    def storage(t: torch.Tensor) -> int:
        return 0 if t.device.type == "meta" else t.untyped_storage().data_ptr()

    def poison(t: torch.Tensor) -> None:
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(t.dtype).max // 3)

    def state(self):
        return self.__dict__.setdefault("_emulated", {"order": [], "owned": {}})

    def replay(self, key, fn):
        st = state(self)
        later = st["order"][st["order"].index(key) + 1:]
        for other in later:  # A's intermediates may lie under the outputs of graphs captured after A
            for t in st["owned"].get(other, ()):
                poison(t)
        fresh = tensors_in([fn()])
        fixed = tensors_in([self.graphs[key].out])
        assert len(fresh) == len(fixed), key
        for f, n in zip(fixed, fresh):
            if f.data_ptr() != n.data_ptr():
                f.copy_(n)
        return self.graphs[key].out

    def capture(self, key, fn, warmup: int = 2):
        if self.executor != "static" and not getattr(self, "_emulating", False):
            return real_capture(self, key, fn, warmup)
        for _ in range(warmup):
            fn()
        births = Births()
        with births:
            out = fn()
        st = state(self)
        st["order"].append(key)
        st["owned"][key] = [t for t in tensors_in([out]) if storage(t) and storage(t) in births.born]
        self.graphs[key] = _Graph(None, out)
        replay(self, key, fn)
        return self.graphs[key]

    def run(self, key, fn):
        if self.executor != "static":
            return real_run(self, key, fn)
        self.calls[key] += 1
        if key not in self.graphs:
            capture(self, key, fn)
        return replay(self, key, fn)

    def setup(self):
        done = self.bufs is not None
        real_setup(self)
        if not done and self.executor == "static":
            self._capture_all()
        return self

    def decode_capture(self, buckets=None):  # plain decode captures on padding before its first step, as on CUDA
        graphs = self.graphs
        if graphs.executor != "static":
            return real_decode_capture(self, buckets)
        graphs.executor, graphs._emulating = "cuda_graph", True
        try:
            return real_decode_capture(self, buckets)
        finally:
            graphs.executor, graphs._emulating = "static", False

    real_capture, real_run, real_setup = GraphSet.capture, GraphSet.run, GraphRunner.setup
    real_decode_capture = DecodeRunner.capture
    monkeypatch.setattr(GraphSet, "capture", capture)
    monkeypatch.setattr(GraphSet, "run", run)
    monkeypatch.setattr(GraphRunner, "setup", setup)
    monkeypatch.setattr(DecodeRunner, "capture", decode_capture)
