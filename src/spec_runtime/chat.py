"""Text prompts as a chat model expects them, where its answer ends, and quiet libraries.

`spec-runtime generate --prompt` and `demo --real` share these: a prompt goes through the target
tokenizer's chat template when it has one (a user turn, an optional system turn, the assistant's
header), and decoding stops at the model's EOS ids (config.json, generation_config.json) and at the
token that closes a turn in its template (`<|im_end|>` for ChatML), found by rendering a turn, so a
folder whose tokenizer names another EOS still stops where the answer ends.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["encode_prompt", "end_of_turn_ids", "has_tokenizer", "load_tokenizer", "note", "quiet_libraries",
           "stop_token_ids"]

_SENTINEL = "Zq7xJ"
"""An assistant message whose rendered form shows what the template writes after a turn."""


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """True when `directory` holds tokenizer files transformers can load."""
    return any((Path(directory) / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json"))


def load_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer saved in `directory` (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def has_chat_template(tokenizer: Any) -> bool:
    """True when `tokenizer` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, text: str, raw: bool = False, system: Optional[str] = None) -> list[int]:
    """`text` as the user's turn through the chat template (with the assistant's header), or as plain
    text when `raw` or the tokenizer has no template (`system` needs the template)."""
    if raw or not has_chat_template(tokenizer):
        return list(tokenizer.encode(text))
    turns = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The special token the chat template writes right after an assistant's message (empty without
    a template, or when no special token follows the message)."""
    if not has_chat_template(tokenizer):
        return set()
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template that refuses this conversation (e.g. needs a system turn): no hint
        return set()
    after = text.split(_SENTINEL, 1)[-1].lstrip() if _SENTINEL in text else ""
    ids = tokenizer.encode(after, add_special_tokens=False)[:1] if after else []
    special = getattr(tokenizer, "added_tokens_decoder", {})
    return {t for t in ids if t in special and getattr(special[t], "special", False)}


def stop_token_ids(directory: str | os.PathLike, tokenizer: Any = None) -> set[int]:
    """Where an answer of the model in `directory` ends: the EOS ids of config.json and
    generation_config.json, the tokenizer's EOS (unless it is also its BOS, a converter's slip),
    and the chat template's end of turn."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(directory) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= {eos} if isinstance(eos, int) else set(eos or [])
    if tokenizer is not None:
        eos, bos = getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)
        if isinstance(eos, int) and eos != bos:
            ids.add(eos)
        ids |= end_of_turn_ids(tokenizer)
    return ids


def note(progress: bool, line: str) -> None:
    """`line` on stderr at once, unless progress is off (`--no-progress`)."""
    if progress:
        print(line, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """Silence transformers' and huggingface_hub's warnings and progress bars, and the fast path's
    (`--no-progress`)."""
    from .options import set_quiet

    set_quiet()
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return
    disable_progress_bars()
