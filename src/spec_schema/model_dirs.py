"""Build a `SpecConfig` from model directories: config.json and safetensors headers, no weights read.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping each
tensor name to its dtype, shape and byte offsets; reading that much is enough to learn every shape.
Sharded checkpoints are found through `model.safetensors.index.json` (its `weight_map`).

EAGLE-3 heads: `fc.weight` is `[hidden, in_features]` with `in_features = target hidden x aux
layers`. The checkpoint's tensor is what the head really reads, so the input width comes from it:
where the config names its aux layers (`num_aux_hidden_states` or
`eagle_config.eagle_aux_hidden_state_layer_ids`) the two must agree (sglang and vLLM size `fc` from
the config and fail to load a checkpoint that disagrees); where it names none, the count is
`in_features / target hidden` (the engines would assume 3: docs/width-rule.md).
"""

import json
import struct
from pathlib import Path
from typing import Any, Optional, Union

import torch
from pydantic import ValidationError

from .config import ModelDims, SpecAlgorithm, SpecConfig
from .widths import aux_layer_width, extend_width

PathLike = Union[str, Path]
_INDEX = "model.safetensors.index.json"
_FC_NAMES = ("fc.weight", "model.fc.weight")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit on the header size


def read_config(model_dir: PathLike) -> dict[str, Any]:
    """The directory's config.json as a dict (errors name the file)."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read the model config: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_safetensors_header(path: PathLike) -> dict[str, Any]:
    """The JSON header of one .safetensors file (tensor name -> dtype, shape, data_offsets)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise ValueError(f"header length {length} exceeds {_MAX_HEADER} bytes")
            raw = f.read(length)
            if len(raw) != length:
                raise ValueError(f"header truncated: {len(raw)} of {length} bytes")
        header = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: unreadable safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: unreadable safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    return header


def tensor_shapes(model_dir: PathLike) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Shape and file of every tensor in the directory's safetensors files (sharded or not)."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index}: cannot read the shard index (weight_map): {error}") from None
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in files:
        for name, info in read_safetensors_header(path).items():
            shapes[name] = (tuple(int(n) for n in info["shape"]), path)
    return shapes


def _dims(model_dir: Path, dtype: Optional[Union[str, torch.dtype]]) -> ModelDims:
    config = read_config(model_dir)
    try:
        return ModelDims.from_hf_config(config, dtype=dtype)
    except KeyError as error:
        raise ValueError(f"{model_dir / 'config.json'}: missing key {error.args[0]!r}") from None
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{model_dir / 'config.json'}: {field + ': ' if field else ''}{first['msg']}") from None
    except ValueError as error:
        raise ValueError(f"{model_dir / 'config.json'}: {error}") from None


def eagle3_dims_from_fc(target: ModelDims, head: ModelDims, head_dir: PathLike) -> ModelDims:
    """The head's dims with its input width resolved from `fc.weight` (see the module text).

    Returns `head` unchanged when aux capture is off or no safetensors file holds the head, and with
    `num_aux_hidden_states` set from `fc.weight` when the config names no aux layers; raises a
    one-line error naming the file and the tensor when the tensor and the config disagree."""
    if not head.use_aux_hidden_state:
        return head  # with aux off the engines bypass fc (vLLM does not even load it)
    shapes = tensor_shapes(head_dir)
    if not shapes:
        return head  # no safetensors (e.g. pytorch_model.bin): the config alone decides
    found = [(name, *shapes[name]) for name in _FC_NAMES if name in shapes]
    if not found:
        raise ValueError(f"{head_dir}: EAGLE-3 head has no tensor {' or '.join(_FC_NAMES)} in its safetensors files")
    name, shape, path = found[0]
    base = aux_layer_width(target, head)
    in_features = shape[-1]
    named = head.aux_layer_ids is not None or head.num_aux_hidden_states is not None
    if len(shape) == 2 and not named and in_features % base == 0:
        return head.model_copy(update={"num_aux_hidden_states": in_features // base})
    expected = extend_width(SpecAlgorithm.EAGLE3, target, head).size
    if len(shape) != 2 or in_features != expected:
        source = ("eagle_aux_hidden_state_layer_ids" if head.aux_layer_ids is not None
                  else "num_aux_hidden_states" if head.num_aux_hidden_states is not None else "the default")
        raise ValueError(
            f"{path}: tensor {name} of shape {list(shape)} reads {in_features / base:g} x target hidden "
            f"{base} = {in_features} features, but the config's aux layers ({source}) give "
            f"{head.num_aux} x {base} = {expected}"
        )
    return head


def spec_config_from_model_dirs(
    algorithm: Union[SpecAlgorithm, str],
    target_dir: PathLike,
    draft_dir: PathLike,
    *,
    num_steps: int,
    topk: int,
    num_draft_tokens: int,
    dtype: Optional[Union[str, torch.dtype]] = None,
    draft_dtype: Optional[Union[str, torch.dtype]] = None,
) -> SpecConfig:
    """A `SpecConfig` from a target and a draft directory (config.json + safetensors headers).

    `dtype` is the dtype both models run in (default: each config's); `draft_dtype` overrides the
    draft's. An EAGLE-3 head's input width comes from its `fc.weight` (`eagle3_dims_from_fc`).
    """
    algorithm = SpecAlgorithm(algorithm)
    target = _dims(Path(target_dir), dtype)
    draft = _dims(Path(draft_dir), draft_dtype if draft_dtype is not None else dtype)
    if algorithm.traits.has_aux_layers:
        draft = eagle3_dims_from_fc(target, draft, draft_dir)
    else:  # EAGLE-3 keys mean nothing to other drafts
        draft = draft.model_copy(update={"draft_vocab_size": None, "aux_layer_ids": None,
                                         "num_aux_hidden_states": None, "target_hidden_size": None})
    return SpecConfig(algorithm=algorithm, target=target, draft=draft, num_steps=num_steps, topk=topk,
                      num_draft_tokens=num_draft_tokens)

