"""Load targets and drafts from local Hugging Face-style directories (never remote code).

A directory holds `config.json` and one of: `model.safetensors`, a sharded
`model.safetensors.index.json`, `pytorch_model.bin` (read with `weights_only=True`) or a sharded
`pytorch_model.bin.index.json`. Every loaded model carries the parsed config dict as `.hf_config`.

An EAGLE-1 draft may carry a hot-token map (`TOKEN_MAP_FILE`, sglang's `--speculative-token-map`
format: a `torch.save`d 1-D integer tensor of distinct target ids), read by `read_token_map`.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from spec_runtime.models.base import CheckpointError
from spec_runtime.models.eagle import Eagle1Head
from spec_runtime.models.eagle3 import Eagle3Head, Eagle3Settings
from spec_runtime.models.llama import LlamaArch, LlamaForCausal, StandaloneDraft, config_to_dict
from spec_schema import SpecAlgorithm

__all__ = [
    "AUTO",
    "TOKEN_MAP_FILE",
    "draft_kind",
    "WEIGHT_FILES",
    "load_eagle1",
    "load_eagle3",
    "load_standalone",
    "load_target",
    "read_config",
    "read_shapes",
    "read_state_dict",
    "read_token_map",
    "resolve_token_map",
]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


TOKEN_MAP_FILE = "token_map.pt"
"""An EAGLE-1 draft directory's hot-token map, used unless the caller names another or none."""

AUTO = "auto"
"""`token_map` value: the draft directory's `TOKEN_MAP_FILE` when it has one, else the full vocabulary."""


# config.json keys every model here needs (a Llama-style decoder), each a positive int
REQUIRED_CONFIG_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_CONFIG_INTS = ("num_key_value_heads", "head_dim", "draft_vocab_size", "target_hidden_size")


def read_config(directory: str | Path) -> dict[str, Any]:
    """`config.json` of `directory` as a dict; raises FileNotFoundError when absent and
    `CheckpointError` naming the file (and the key) when it is not JSON, not an object, or lacks a
    required size or has one that is not a positive int."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    cfg = _read_json(path)
    for key in REQUIRED_CONFIG_INTS:
        if key not in cfg:
            raise CheckpointError(f"{path} has no {key!r} (needed: {', '.join(REQUIRED_CONFIG_INTS)})")
    for key in (*REQUIRED_CONFIG_INTS, *OPTIONAL_CONFIG_INTS):
        value = cfg.get(key)
        if (key in REQUIRED_CONFIG_INTS or value is not None) and not _positive_int(value):
            raise CheckpointError(f"{path}: {key} must be a positive int, got {value!r}")
    return cfg


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; `CheckpointError` naming the file when it is not one."""
    try:
        with path.open() as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _check_no_remote_code(cfg: Mapping[str, Any], source: str) -> None:
    if cfg.get("auto_map"):
        raise CheckpointError(
            f"{source} needs remote code (config auto_map {sorted(cfg['auto_map'])}); "
            "spec_runtime never uses trust_remote_code"
        )


def _read_file(path: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """One weights file; `CheckpointError` naming it when it cannot be read (truncated, corrupted).
    `meta` (safetensors only): meta tensors of the header's shapes, no tensor data read."""
    try:
        if path.suffix == ".safetensors":
            if meta:
                with safe_open(str(path), "pt") as f:
                    return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
            return load_file(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise  # permissions and the like: the message names the file already
    except Exception as err:  # safetensors' SafetensorError, torch's unpickling and zip errors
        raise CheckpointError(f"cannot read {path} (truncated or corrupted?): {type(err).__name__}: {err}") from None


def _read_sharded(index: Path, meta: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map object of tensor name -> shard file")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index.parent / shard
        if not shard_path.is_file():
            raise FileNotFoundError(f"shard {shard} listed in {index} is missing")
        tensors.update(_read_file(shard_path, meta))
    return tensors, f"{index} ({len(set(weight_map.values()))} shards)"


def _weights_file(directory: str | Path) -> Path:
    """The first of `WEIGHT_FILES` in `directory`."""
    for name in WEIGHT_FILES:
        path = Path(directory) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"no weights file found in {directory}: looked for {', '.join(WEIGHT_FILES)}")


def _read_weights(path: Path, meta: bool) -> tuple[dict[str, torch.Tensor], str]:
    if path.name.endswith(".index.json"):
        return _read_sharded(path, meta)
    return _read_file(path, meta), str(path)


def read_state_dict(directory: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a checkpoint directory on CPU, and a description of the file(s) for errors."""
    return _read_weights(_weights_file(directory), meta=False)


def read_shapes(directory: str | Path) -> tuple[dict[str, torch.Tensor], str] | None:
    """`read_state_dict`'s tensors as meta tensors of their shapes, from the safetensors headers only
    (no tensor data read; the same errors for an unreadable file); None for weights in another format."""
    path = _weights_file(directory)
    return _read_weights(path, meta=True) if path.name.startswith("model.safetensors") else None


def _strip_prefix(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Drop `prefix` when every key has it (some converted draft heads are saved as `model.*`)."""
    if sd and all(k.startswith(prefix) for k in sd):
        return {k[len(prefix):]: v for k, v in sd.items()}
    return sd


def load_target(src: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LlamaForCausal:
    """Load a Llama/Qwen2/Mistral target from a directory or a `transformers` PreTrainedModel."""
    if isinstance(src, (str, Path)):
        cfg = read_config(src)
        _check_no_remote_code(cfg, str(src))
        arch = LlamaArch.from_hf_config(cfg)
        sd, source = read_state_dict(src)
    elif hasattr(src, "config") and hasattr(src, "state_dict"):
        cfg, sd, source = config_to_dict(src.config), dict(src.state_dict()), f"{type(src).__name__} instance"
        arch = LlamaArch.from_hf_config(cfg)
    else:
        raise TypeError(f"load_target expects a directory or a transformers model, got {type(src).__name__}")
    model = LlamaForCausal(arch, dtype, device)
    model.load_state_dict_checked(sd, source)
    model.hf_config = cfg
    return model.eval()


def _head_arch(cfg: Mapping[str, Any]) -> LlamaArch:
    """A draft head's config is a Llama config; some omit `model_type`."""
    return LlamaArch.from_hf_config({**cfg, "model_type": cfg.get("model_type") or "llama"})


def resolve_token_map(directory: str | Path, token_map: str | Path | None = AUTO) -> Path | None:
    """The hot-token map file an EAGLE-1 draft in `directory` reads: `token_map` itself when it names
    one, none for None, and for `AUTO` the directory's `TOKEN_MAP_FILE` when present."""
    if token_map is None:
        return None
    if isinstance(token_map, str) and token_map == AUTO:
        path = Path(directory) / TOKEN_MAP_FILE
        return path if path.is_file() else None
    return Path(token_map)


def read_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """A hot-token map file as `(n,)` int64 target ids, in the file's order (draft index i scores
    target id ids[i]). `CheckpointError` on one line naming the file: unreadable, not a non-empty 1-D
    integer tensor (or list of ints), an id outside [0, vocab_size), or an id listed twice."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"token map {path}: " + ("a directory, not a file" if path.is_dir() else "file not found"))
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling, zip and OS errors alike: the file is not a saved tensor
        raise CheckpointError(f"token map {path}: cannot read it as a torch-saved id tensor "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    ids = _token_map_ids(data, path)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise CheckpointError(f"token map {path}: id {int(bad[0])} is outside the target vocabulary [0, {vocab_size})")
    unique, counts = ids.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise CheckpointError(f"token map {path}: id {int(unique[counts > 1][0])} is listed "
                              f"{int(counts.max())} times; each id must appear once")
    return ids


def _token_map_ids(data: object, path: Path) -> torch.Tensor:
    """The ids of a loaded map: an integer tensor or a list of ints, 1-D and non-empty."""
    if isinstance(data, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        data = torch.tensor(data, dtype=torch.int64)
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"token map {path}: holds a {type(data).__name__}, expected a 1-D integer tensor of target ids")
    if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
        raise CheckpointError(f"token map {path}: dtype {data.dtype}, expected an integer dtype (int64)")
    if data.dim() != 1 or data.numel() == 0:
        raise CheckpointError(f"token map {path}: shape {tuple(data.shape)}, expected (n,) with n >= 1 target ids")
    return data.to(torch.int64)


def load_eagle1(directory: str | Path, target: LlamaForCausal, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", token_map: str | Path | None = AUTO) -> Eagle1Head:
    """Load an EAGLE-1 head (config `bias` defaults to True, as in the EAGLE repo). `token_map`: a
    hot-token map file, None for the full vocabulary, `AUTO` for the directory's `TOKEN_MAP_FILE` if any;
    the map is read and checked before the weights."""
    cfg = read_config(directory)
    _check_no_remote_code(cfg, str(directory))
    map_path = resolve_token_map(directory, token_map)
    hot = None if map_path is None else read_token_map(map_path, target.vocab_size)
    sd, source = read_state_dict(directory)
    sd = _strip_prefix(sd, "model.")
    head = Eagle1Head(
        _head_arch(cfg), target, bias=bool(cfg.get("bias", True)),
        own_embed="embed_tokens.weight" in sd, own_lm_head="lm_head.weight" in sd, dtype=dtype, device=device,
    )
    head.load_state_dict_checked(sd, source)
    if hot is not None:
        head.set_token_map(hot)
    head.hf_config = cfg
    return head.eval()


def load_eagle3(directory: str | Path, target: LlamaForCausal, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Eagle3Head:
    """Load an EAGLE-3 head; the fc input width must be target hidden x number of aux layers."""
    cfg = read_config(directory)
    _check_no_remote_code(cfg, str(directory))
    sd, source = read_state_dict(directory)
    settings = Eagle3Settings.from_config(cfg, target)
    head = Eagle3Head(
        _head_arch(cfg), settings, target,
        own_embed="embed_tokens.weight" in sd, dtype=dtype, device=device,
    )
    head.load_state_dict_checked(sd, source)
    head.hf_config = cfg
    return head.eval()


def load_standalone(directory: str | Path, target: LlamaForCausal, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> StandaloneDraft:
    """Load a small causal LM as a STANDALONE draft; its vocabulary must equal the target's."""
    cfg = read_config(directory)
    vocab = cfg.get("vocab_size")
    if vocab != target.vocab_size:
        raise CheckpointError(
            f"STANDALONE draft vocab_size {vocab} differs from the target vocab_size {target.vocab_size}; "
            "they must be equal"
        )
    return StandaloneDraft(load_target(directory, dtype, device))


def draft_kind(directory: str | Path) -> tuple[SpecAlgorithm, str] | None:
    """Which algorithm's draft `directory` looks like, and by what: config.json's `architectures` naming
    EAGLE-3, else the safetensors header (no tensor read): `d2t` or `midlayer.*` (EAGLE-3), an `fc` of
    input width 2 x hidden (EAGLE-1) or 3 or more (EAGLE-3), no `fc` but a whole model's embedding, layers
    and final norm (STANDALONE). None when it cannot tell (another weights format, an unreadable file). A
    default (`generate` without `--speculative-algorithm`) and a hint for a load that failed, never a check:
    the loader still checks every shape."""
    try:
        arch = " ".join(map(str, read_config(directory).get("architectures") or []))
        if "eagle3" in arch.lower():
            return SpecAlgorithm.EAGLE3, f"config.json architectures {arch}"
        shapes = read_shapes(directory)
    except (OSError, ValueError):
        return None
    if shapes is None:
        return None
    sd = {k.removeprefix("model."): v for k, v in shapes[0].items()}  # heads saved as model.*, HF causal LMs
    if "d2t" in sd or any(k.startswith("midlayer.") for k in sd):
        return SpecAlgorithm.EAGLE3, "its weights have d2t / midlayer"
    fc = sd.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[0] > 0 and fc.shape[1] % fc.shape[0] == 0:
        ratio = fc.shape[1] // fc.shape[0]
        if ratio == 2:
            return SpecAlgorithm.EAGLE, f"fc.weight {tuple(fc.shape)}: input 2 x hidden"
        if ratio >= 3:
            return SpecAlgorithm.EAGLE3, f"fc.weight {tuple(fc.shape)}: input {ratio} x hidden"
    if fc is None and {"embed_tokens.weight", "norm.weight"} <= sd.keys() and any(k.startswith("layers.") for k in sd):
        return SpecAlgorithm.STANDALONE, "its weights: a whole causal LM, no fc"
    return None


DRAFT_LOADERS = {SpecAlgorithm.EAGLE: load_eagle1, SpecAlgorithm.EAGLE3: load_eagle3,
                 SpecAlgorithm.STANDALONE: load_standalone}
"""The loader of each algorithm's draft: `DRAFT_LOADERS[alg](directory, target, dtype, device)`."""
