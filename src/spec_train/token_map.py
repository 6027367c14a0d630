"""Hot-token maps for EAGLE-1 drafts (FR-Spec; sglang's `--speculative-token-map`): the target tokens
the draft may propose, the most frequent ones of the target's own continuations of training prompts.

    python -m spec_train.token_map --data OUTPUT/train_data.pt --vocab-size 49152 --size 8192 \\
        [--fill-from EAGLE3_DRAFT_DIR] --out DRAFT_DIR/token_map.pt

`--data` (repeatable): a trainer's data cache (`train_data.pt`: its sequences' continuations) or a JSON
list of rows, each with `"cont"` (a continuation's token ids). Give training rows only: a map counted on
held-out rows flatters their measurement. Tokens are ranked by their count there (the trainer's counting
of EAGLE-3's draft vocabulary, `losses.most_frequent`); `--fill-from` ranks the tokens the data never saw
(or saw equally often) by membership in an EAGLE-3 draft's vocabulary (its `d2t`, itself counted on its
run's training continuations), then by id. The file is a `torch.save`d int64 tensor of target ids sorted
by id, the format sglang's `--speculative-token-map` and `spec_runtime`'s loader read.
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from spec_train.config import TrainError
from spec_train.data import Sequences
from spec_train.losses import most_frequent

__all__ = ["continuation_tokens", "draft_vocabulary", "hot_token_ids", "main"]


def hot_token_ids(tokens: Sequence[int], vocab_size: int, size: int,
                  fill: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The `size` most frequent of `tokens` (int64 target ids, sorted by id); ties and unseen tokens go
    to the ids in `fill` first (a draft vocabulary), then by id."""
    if not 1 <= size <= vocab_size:
        raise TrainError(f"--size {size}: must be between 1 and the vocabulary size {vocab_size}")
    counts = torch.bincount(torch.tensor(list(tokens), dtype=torch.int64), minlength=vocab_size).double() * 2
    if fill is not None:
        counts[fill] += 1  # below one more occurrence, above none
    return most_frequent(counts, size)


def continuation_tokens(path: Path, vocab_size: int) -> list[int]:
    """Every continuation token of one `--data` file (a trainer data cache or JSON rows with "cont")."""
    flag = f"--data {path}"
    if not path.is_file():
        raise TrainError(f"{flag}: " + ("a directory, not a file" if path.is_dir() else "file not found"))
    tokens = _json_tokens(path, flag) if path.suffix == ".json" else _cache_tokens(path, flag)
    bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise TrainError(f"{flag}: token {bad[0]!r} is not an id in [0, {vocab_size})")
    return tokens


def _json_tokens(path: Path, flag: str) -> list[int]:
    try:
        rows = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TrainError(f"{flag}: not valid JSON ({err})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("cont"), list) for r in rows):
        raise TrainError(f'{flag}: expected a JSON list of rows, each with "cont" (a list of token ids)')
    return [t for r in rows for t in r["cont"]]


def _cache_tokens(path: Path, flag: str) -> list[int]:
    try:
        data: Any = torch.load(path, map_location="cpu", weights_only=True)
        return Sequences.from_dict(data["data"]).continuation_tokens()
    except Exception as err:  # unpickling errors, or a file of another layout
        raise TrainError(f"{flag}: not a trainer data cache ({type(err).__name__}: {err})") from None


def draft_vocabulary(directory: Path, vocab_size: int) -> torch.Tensor:
    """The target ids of an EAGLE-3 draft's vocabulary (`d2t` offsets of its checkpoint)."""
    from spec_runtime.models.loading import read_state_dict

    flag = f"--fill-from {directory}"
    try:
        d2t = read_state_dict(directory)[0].get("d2t")
    except (OSError, ValueError) as err:
        raise TrainError(f"{flag}: {err}") from None
    if d2t is None or d2t.dim() != 1:
        raise TrainError(f"{flag}: no 1-D d2t tensor (an EAGLE-3 draft's vocabulary) in its weights")
    ids = torch.arange(d2t.numel()) + d2t.long()
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise TrainError(f"{flag}: its d2t maps ids outside [0, {vocab_size})")
    return ids


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Build a hot-token map file; one `error:` line and exit code 2 on bad input."""
    p = argparse.ArgumentParser(prog="python -m spec_train.token_map", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, action="append", required=True, help="training continuations (repeatable)")
    p.add_argument("--vocab-size", type=int, required=True, help="the target's vocabulary size")
    p.add_argument("--size", type=int, default=8192, help="ids in the map")
    p.add_argument("--fill-from", type=Path, default=None, help="EAGLE-3 draft directory ranking unseen tokens")
    p.add_argument("--out", type=Path, required=True, help="map file to write (e.g. DRAFT_DIR/token_map.pt)")
    args = p.parse_args(argv)
    try:
        if not args.out.parent.is_dir():
            raise TrainError(f"--out {args.out}: no directory {args.out.parent}")
        tokens = [t for path in args.data for t in continuation_tokens(path, args.vocab_size)]
        fill = None if args.fill_from is None else draft_vocabulary(args.fill_from, args.vocab_size)
        ids = hot_token_ids(tokens, args.vocab_size, args.size, fill)
    except TrainError as err:
        p.error(str(err))
    torch.save(ids, args.out)
    seen = int((torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=args.vocab_size) > 0).sum())
    print(f"{args.out}: {ids.numel()} ids from {len(tokens)} continuation tokens ({seen} distinct)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
