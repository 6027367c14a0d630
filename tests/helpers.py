"""Small helpers shared by test modules of several folders."""


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
