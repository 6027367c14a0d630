"""Tests for spec_schema.export: drift, meta-schema validity, example documents, round trips."""

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

import spec_schema
from spec_schema import (
    PHASE_CLASSES,
    DraftExtendInput,
    DraftInput,
    ModelDims,
    SpecConfig,
    SpecContractError,
    VerifyInput,
    VerifyOutput,
    export,
    hidden_width,
)

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas"
FILES = [f"{cls.__name__}.schema.json" for cls in (*PHASE_CLASSES, *spec_schema.CHAIN_CLASSES)]
FILES += ["SpecConfig.schema.json"]

# ----------------------------------------------------------------------------------------------
# Configs and example objects
# ----------------------------------------------------------------------------------------------

VOCAB = 128


def _config(name: str) -> SpecConfig:
    if name == "EAGLE3":
        target = ModelDims(hidden_size=64, vocab_size=VOCAB, dtype="bfloat16", num_hidden_layers=8)
        draft = ModelDims(hidden_size=48, vocab_size=VOCAB, dtype="float16", draft_vocab_size=96,
                          aux_layer_ids=(1, 4, 5), target_hidden_size=64)
        return SpecConfig(algorithm="EAGLE3", target=target, draft=draft, num_steps=3, topk=2, num_draft_tokens=6)
    if name == "STANDALONE":
        target = ModelDims(hidden_size=64, vocab_size=VOCAB, dtype="float32")
        draft = ModelDims(hidden_size=32, vocab_size=VOCAB, dtype="float32")
        return SpecConfig(algorithm="STANDALONE", target=target, draft=draft, num_steps=3, topk=1, num_draft_tokens=4)
    target = ModelDims(hidden_size=64, vocab_size=VOCAB, dtype="float32")
    draft = ModelDims(hidden_size=64, vocab_size=VOCAB, dtype="float32")
    return SpecConfig(algorithm="EAGLE", target=target, draft=draft, num_steps=3, topk=2, num_draft_tokens=6)


ALGORITHMS = ["EAGLE", "EAGLE3", "STANDALONE"]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _ids(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=g, dtype=torch.int64)


def _hidden(config: SpecConfig, phase: str, rows: int, g: torch.Generator) -> Any:
    w = hidden_width(config, phase)
    return None if w.size is None else torch.randn(rows, w.size, generator=g).to(w.dtype)


def _sampled_chain(config: SpecConfig) -> bool:
    return not config.traits.draft_reads_hidden and config.topk == 1


def _probs(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=g), dim=-1)


def live_draft_input(config: SpecConfig, bs: int = 2) -> DraftInput:
    g = _gen()
    return DraftInput(
        topk_p=_probs(g, bs, config.topk),
        topk_index=_ids(g, bs, config.topk),
        hidden_states=_hidden(config, "draft", bs, g),
        bonus_tokens=_ids(g, bs),
        seq_lens=torch.arange(5, 5 + bs, dtype=torch.int64),
        req_pool_indices=torch.arange(bs, dtype=torch.int64),
        draft_probs=_probs(g, bs, config.vocab) if _sampled_chain(config) else None,
    )


def _parents(n: int, k: int) -> list[int]:
    """A valid tree layout: chain for topk 1, else root -> k children, then node i under node i - k."""
    return [-1] + [i - 1 if k == 1 else (0 if i <= k else i - k) for i in range(1, n)]


def _links(parents: list[int]) -> tuple[list[int], list[int], list[int]]:
    n = len(parents)
    depth, first, sibling = [0] * n, [-1] * n, [-1] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        kids = [j for j in range(1, n) if parents[j] == parents[i]]
        later = [j for j in kids if j > i]
        sibling[i] = later[0] if later else -1
        if first[parents[i]] == -1:
            first[parents[i]] = i
    return depth, first, sibling


def live_verify_input(config: SpecConfig, bs: int = 2) -> VerifyInput:
    g, n = _gen(), config.num_draft_tokens
    parents = _parents(n, config.topk)
    depth, first, sibling = _links(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    seq_lens = torch.arange(7, 7 + bs, dtype=torch.int64)
    rows = lambda v: torch.tensor(v, dtype=torch.int64).expand(bs, n).clone()  # noqa: E731
    return VerifyInput(
        draft_token=_ids(g, bs, n),
        positions=seq_lens[:, None] + rows(depth),
        tree_mask=mask.expand(bs, n, n).clone(),
        retrieve_index=torch.arange(bs * n, dtype=torch.int64).reshape(bs, n),
        retrieve_next_token=rows(first),
        retrieve_next_sibling=rows(sibling),
        seq_lens=seq_lens,
        req_pool_indices=torch.arange(bs, dtype=torch.int64),
        draft_probs=_probs(g, bs, n, config.vocab) if _sampled_chain(config) else None,
    )


def live_draft_extend_input(config: SpecConfig, correct: tuple[int, ...] = (1, 0)) -> DraftExtendInput:
    g = _gen()
    c = torch.tensor(correct, dtype=torch.int32)
    a = c + 1
    rows = int(a.sum())
    seq_lens = torch.arange(10, 10 + len(correct), dtype=torch.int64) + a
    ids = _ids(g, rows)
    last = torch.cumsum(a.long(), 0) - 1
    # the draft's KV lead: a STANDALONE draft reads its rows at their own positions, one on
    starts = torch.repeat_interleave(seq_lens - a + config.traits.draft_kv_lead, a)
    offsets = torch.arange(rows) - torch.repeat_interleave(torch.cumsum(a.long(), 0) - a, a)
    return DraftExtendInput(
        hidden_states=_hidden(config, "extend", rows, g),
        input_ids=ids,
        positions=starts + offsets,
        num_correct_drafts=c,
        num_accept_tokens=a.clone(),
        seq_lens=seq_lens,
        bonus_tokens=ids[last],
        req_pool_indices=torch.arange(len(correct), dtype=torch.int64),
        num_accept_tokens_cpu=tuple(a.tolist()),
    )


def live_verify_output(config: SpecConfig) -> VerifyOutput:
    g, n, w = _gen(), config.num_draft_tokens, config.num_steps + 1
    correct, finished = [1, 0, 2], [False, True, False]
    tokens = torch.full((3, w), -1, dtype=torch.int64)
    indices = torch.full((3, w), -1, dtype=torch.int64)
    for b, c in enumerate(correct):
        tokens[b, : c + 1] = _ids(g, c + 1)
        indices[b, : c + 1] = b * n + torch.arange(c + 1)
    unfinished = tuple(c for c, f in zip(correct, finished) if not f)
    c32 = torch.tensor(correct, dtype=torch.int32)
    return VerifyOutput(
        accept_tokens=tokens,
        accept_indices=indices,
        num_correct_drafts=c32,
        num_accept_tokens=c32 + 1,
        finished=torch.tensor(finished),
        draft_extend_input=live_draft_extend_input(config, unfinished),
    )


LIVE = {
    DraftInput: live_draft_input,
    VerifyInput: live_verify_input,
    VerifyOutput: live_verify_output,
    DraftExtendInput: live_draft_extend_input,
}


def example(cls: type, algorithm: str, state: str) -> tuple[Any, SpecConfig]:
    """A live or idle object of `cls` under the test config of `algorithm`, checked against the contract."""
    config = _config(algorithm)
    obj = LIVE[cls](config) if state == "live" else cls.create_idle(config)
    spec_schema.check(obj, cls, config, values=True)
    return obj, config


CASES = [(cls, alg, state) for cls in PHASE_CLASSES for alg in ALGORITHMS for state in ("live", "idle")]
IDS = [f"{cls.__name__}-{alg}-{state}" for cls, alg, state in CASES]


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text())


def _validator(cls: type) -> Draft202012Validator:
    return Draft202012Validator(_schema(f"{cls.__name__}.schema.json"))


def _json(doc: Any) -> Any:
    return json.loads(json.dumps(doc))


# ----------------------------------------------------------------------------------------------
# Drift and meta-schema
# ----------------------------------------------------------------------------------------------


def test_committed_schemas_equal_a_fresh_export():
    generated = export.generate()
    assert sorted(generated) == sorted(FILES)
    for name, text in generated.items():
        assert (SCHEMAS / name).read_text(encoding="utf-8") == text, f"{name} drifted: run python -m spec_schema.export"
    assert export.drift(SCHEMAS) == []


def test_export_is_deterministic():
    assert export.generate() == export.generate()


def test_check_command_passes_on_committed_schemas():
    proc = subprocess.run(
        [sys.executable, "-m", "spec_schema.export", "--check", "--out", str(SCHEMAS)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout


def test_check_reports_drift_missing_and_stale(tmp_path, capsys):
    export.write(tmp_path)
    assert export.main(["--check", "--out", str(tmp_path)]) == 0
    path = tmp_path / "DraftInput.schema.json"
    path.write_text(path.read_text().replace('"bs"', '"batch"', 1))
    (tmp_path / "VerifyInput.schema.json").unlink()
    (tmp_path / "Old.schema.json").write_text("{}\n")
    assert export.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "DraftInput.schema.json: differs (2 lines changed)" in err
    assert "VerifyInput.schema.json: missing" in err
    assert "Old.schema.json: not generated" in err
    export.write(tmp_path)
    assert not (tmp_path / "Old.schema.json").exists()
    assert export.drift(tmp_path) == []


def test_export_leaves_the_classes_unchanged():
    before = {cls: dict(vars(cls)) for cls in PHASE_CLASSES}
    export.generate()
    for cls in PHASE_CLASSES:
        assert dict(vars(cls)) == before[cls]
        assert "__pydantic_config__" not in vars(cls)


@pytest.mark.parametrize("name", FILES)
def test_schema_files_are_valid_draft_2020_12(name):
    schema = _schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(name)


def test_config_schema_validates_a_config_and_rejects_extras():
    validator = Draft202012Validator(_schema("SpecConfig.schema.json"))
    doc = _config("EAGLE3").model_dump(mode="json")
    validator.validate(doc)
    with pytest.raises(ValidationError):
        validator.validate({**doc, "hidden": 4096})


# ----------------------------------------------------------------------------------------------
# Schema content
# ----------------------------------------------------------------------------------------------


def _tensor_props(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, prop in schema["properties"].items():
        for option in prop.get("anyOf", [prop]):
            if option.get("title") == "Tensor":
                out[name] = option
    return out


def test_tensor_schema_shape_dtype_and_data():
    schema = _schema("DraftInput.schema.json")
    tensors = _tensor_props(schema)
    hidden = tensors["hidden_states"]
    assert hidden["x-shape"] == ["bs", "hidden_draft"]
    assert hidden["x-dtypes"] == ["bfloat16", "float16", "float32"]
    assert hidden["properties"]["dtype"]["enum"] == hidden["x-dtypes"]
    assert hidden["properties"]["shape"]["minItems"] == hidden["properties"]["shape"]["maxItems"] == 2
    assert tensors["topk_index"]["x-dtypes"] == ["int64"]
    assert tensors["bonus_tokens"]["properties"]["data"] == {"type": "array", "items": {"type": "integer"}}
    mask = _tensor_props(_schema("VerifyInput.schema.json"))["tree_mask"]
    assert mask["x-dtypes"] == ["bool"] and mask["properties"]["shape"]["maxItems"] == 3


@pytest.mark.parametrize("cls", PHASE_CLASSES, ids=lambda c: c.__name__)
def test_descriptions_come_from_field_docs(cls):
    schema = _schema(f"{cls.__name__}.schema.json")
    bodies = [(cls, schema)] + [(getattr(spec_schema, n), d) for n, d in schema.get("$defs", {}).items()]
    for owner, body in bodies:
        for f in dataclasses.fields(owner):
            assert body["properties"][f.name]["description"] == f.metadata["doc"]


def _x_shapes(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = set(node.get("x-shape", []))
        return own.union(*(_x_shapes(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_x_shapes(v) for v in node))
    return set()


@pytest.mark.parametrize("cls", PHASE_CLASSES, ids=lambda c: c.__name__)
def test_every_axis_is_explained(cls):
    schema = _schema(f"{cls.__name__}.schema.json")
    assert _x_shapes(schema) <= set(schema["x-axes"])
    assert "num_steps + 1" in schema["x-axes"]["accept_width"]


def test_none_for_hidden_states_is_standalone():
    for cls in (DraftInput, DraftExtendInput):
        rule = _schema(f"{cls.__name__}.schema.json")["x-none-for"]["hidden_states"]
        assert rule["algorithms"] == ["STANDALONE"] and rule["conditional"] == []
    nested = _schema("VerifyOutput.schema.json")["x-none-for"]["draft_extend_input.hidden_states"]
    assert nested["algorithms"] == ["STANDALONE"]


def test_none_for_draft_probs_comes_from_the_field_doc():
    rule = _schema("VerifyInput.schema.json")["x-none-for"]["draft_probs"]
    doc = next(f.metadata["doc"] for f in dataclasses.fields(VerifyInput) if f.name == "draft_probs")
    assert rule == {"algorithms": ["EAGLE", "EAGLE3"], "conditional": ["STANDALONE"], "condition": doc}


def test_none_for_a_field_whose_doc_names_no_algorithm_is_conditional_for_all():
    rule = _schema("DraftExtendInput.schema.json")["x-none-for"]["num_accept_tokens_cpu"]
    assert rule["algorithms"] == [] and rule["conditional"] == ALGORITHMS
    nested = _schema("VerifyOutput.schema.json")["x-none-for"]["draft_extend_input.num_accept_tokens_cpu"]
    assert nested == rule


def _rows(cls: type, path: str = "hidden_states") -> dict[tuple[str, Any], tuple[Any, Any]]:
    rule = _schema(f"{cls.__name__}.schema.json")["x-width-rule"][path]
    return {(r["algorithm"], r.get("use_aux_hidden_state")): (r["width"], r["dtype"]) for r in rule["rows"]}


def test_width_rule_as_data_matches_the_design_table():
    assert _rows(DraftInput) == {
        ("EAGLE", None): ("draft.hidden_size * draft.hc_mult", "draft.dtype"),
        ("EAGLE3", True): ("draft.hidden_size * draft.hc_mult", "draft.dtype"),
        ("EAGLE3", False): ("draft.hidden_size * draft.hc_mult", "draft.dtype"),
        ("STANDALONE", None): (None, None),
    }
    assert _rows(DraftExtendInput) == {
        ("EAGLE", None): ("target.hidden_size * target.hc_mult", "target.dtype"),
        # a head's target_hidden_size must equal the target's (SpecConfig validates it), so the rule
        # reads the target's hidden size
        ("EAGLE3", True): ("target.hidden_size * num_aux", "target.dtype"),
        ("EAGLE3", False): ("target.hidden_size * target.hc_mult", "target.dtype"),
        ("STANDALONE", None): (None, None),
    }
    assert _rows(VerifyOutput, "draft_extend_input.hidden_states") == _rows(DraftExtendInput)
    assert "x-width-rule" in _schema("VerifyInput.schema.json")
    assert _schema("VerifyInput.schema.json")["x-width-rule"] == {}


# ----------------------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "algorithm", "state"), CASES, ids=IDS)
def test_example_documents_validate(cls, algorithm, state):
    obj, _ = example(cls, algorithm, state)
    _validator(cls).validate(_json(export.to_document(obj)))


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None or y is None:
            assert x is None and y is None, f.name
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif dataclasses.is_dataclass(x):
            _assert_same(x, y)
        else:
            assert type(x) is type(y) and x == y, f.name


@pytest.mark.parametrize(("cls", "algorithm", "state"), CASES, ids=IDS)
def test_documents_round_trip(cls, algorithm, state):
    obj, config = example(cls, algorithm, state)
    back = export.from_document(cls, _json(export.to_document(obj)))
    _assert_same(obj, back)
    spec_schema.check(back, cls, config, values=True)


def _rejects(cls: type, doc: Any) -> None:
    with pytest.raises(ValidationError):
        _validator(cls).validate(doc)


def test_corrupted_documents_fail_validation():
    doc = _json(export.to_document(example(DraftInput, "EAGLE3", "live")[0]))
    wrong_dtype = copy.deepcopy(doc)
    wrong_dtype["topk_index"]["dtype"] = "int32"
    _rejects(DraftInput, wrong_dtype)
    fp8 = copy.deepcopy(doc)
    fp8["hidden_states"]["dtype"] = "float8_e4m3fn"
    _rejects(DraftInput, fp8)
    wrong_rank = copy.deepcopy(doc)
    wrong_rank["topk_p"]["shape"] = [2, 2, 1]
    _rejects(DraftInput, wrong_rank)
    flat = copy.deepcopy(doc)
    flat["topk_p"]["data"] = [x for row in doc["topk_p"]["data"] for x in row]
    _rejects(DraftInput, flat)
    _rejects(DraftInput, {k: v for k, v in doc.items() if k != "seq_lens"})
    _rejects(DraftInput, {**doc, "hidden": None})
    host = _json(export.to_document(example(DraftExtendInput, "EAGLE", "live")[0]))
    host["num_accept_tokens_cpu"] = ["2", 1]
    _rejects(DraftExtendInput, host)


def test_corrupted_nested_document_fails_validation():
    doc = _json(export.to_document(example(VerifyOutput, "EAGLE", "live")[0]))
    doc["draft_extend_input"]["num_accept_tokens"]["dtype"] = "int64"
    _rejects(VerifyOutput, doc)


def test_from_document_rejects_wrong_dtype_rank_and_fields():
    doc = _json(export.to_document(example(DraftInput, "EAGLE", "live")[0]))
    bad = copy.deepcopy(doc)
    bad["topk_index"]["dtype"] = "int32"
    with pytest.raises(SpecContractError, match=r"DraftInput\.topk_index: document tensor has dtype torch\.int32"):
        export.from_document(DraftInput, bad)
    bad = copy.deepcopy(doc)
    bad["seq_lens"] = {"dtype": "int64", "shape": [1, 2], "data": [doc["seq_lens"]["data"]]}
    with pytest.raises(SpecContractError, match="rank 2"):
        export.from_document(DraftInput, bad)
    bad = copy.deepcopy(doc)
    bad["seq_lens"]["shape"] = [3]
    with pytest.raises(ValueError, match=r"data has shape \(2,\) but shape says \(3,\)"):
        export.from_document(DraftInput, bad)
    with pytest.raises(ValueError, match=r"unknown fields \['hidden'\]"):
        export.from_document(DraftInput, {**doc, "hidden": None})
    with pytest.raises(ValueError, match=r"missing fields \['seq_lens'\]"):
        export.from_document(DraftInput, {k: v for k, v in doc.items() if k != "seq_lens"})


def test_fields_with_defaults_may_be_left_out():
    obj, _ = example(DraftExtendInput, "EAGLE3", "live")
    doc = _json(export.to_document(obj))
    assert doc["num_accept_tokens_cpu"] == [2, 1]
    del doc["num_accept_tokens_cpu"]
    _validator(DraftExtendInput).validate(doc)
    assert export.from_document(DraftExtendInput, doc).num_accept_tokens_cpu is None


def test_non_finite_floats_round_trip_as_strings():
    t = torch.tensor([[1.5, float("nan")], [float("inf"), -float("inf")]], dtype=torch.bfloat16)
    doc = _json(export.tensor_to_document(t))
    assert doc["data"][0][1] == "nan" and doc["data"][1] == ["inf", "-inf"]
    back = export.tensor_from_document(doc)
    assert back.dtype == torch.bfloat16 and torch.equal(back.isnan(), t.isnan())
    assert torch.equal(back.nan_to_num(0.0), t.nan_to_num(0.0))
