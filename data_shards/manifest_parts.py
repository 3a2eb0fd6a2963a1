"""The per-rank manifest parts of a tokenize split over ranks, and their merge into the one manifest.

A rank of a `--world-size` > 1 tokenize writes its part (`part_name`); `merge_parts` writes from all of them the
same manifest bytes as a one-process run writes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from data_shards.raw import ShardError
from data_shards.token_shards import manifest_entry, read_shard_meta, write_manifest

__all__ = ["ENCODER_FIELDS", "PART_FORMAT", "merge_parts", "part_name", "ranks_of"]

# The header fields naming the device and dtype that computed the shards' image codes (and features): other
# hardware or precision can round a latent to another code, so parts made otherwise are never merged (and
# `pretokenize` tokenizes a shard made otherwise again rather than mixing it with this run's).
ENCODER_FIELDS = ("encoder_device", "encoder_dtype")
# Per-rank parts of a tokenize split over ranks (`--world-size` > 1), merged into the manifest by `merge_parts`.
PART_FORMAT = "early-fusion-tokens-part/1"
_PART_NAME = re.compile(r"^manifest\.part-(?P<rank>\d+)-of-(?P<world>\d+)\.json$")


def part_name(rank: int, world_size: int) -> str:
    """The file name of rank `rank`'s manifest part on a `world_size`-rank tokenize."""
    return f"manifest.part-{rank:05d}-of-{world_size:05d}.json"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def ranks_of(ranks: list[int], world_size: int) -> str:
    """"rank 1 of 4 has" / "ranks 1, 3 of 4 have"."""
    return f"rank {ranks[0]} of {world_size} has" if len(ranks) == 1 else f"ranks {_ranks(ranks)} of {world_size} have"


# The `shards tokenize` flag of a header field, where the advice to rerun a rank can name one.
_FLAGS = {"seed": "--seed", "flip_probability": "--flip-probability", "target_roles": "--train-roles"}
# At most this many files are listed by name in the advice to delete a rank's shards (the rest are counted).
MAX_LISTED_FILES = 20


def _flag_value(value: object) -> str:
    """A header value as its command-line flag takes it (a list of roles as `assistant,user`)."""
    return ",".join(str(item) for item in value) if isinstance(value, (list, tuple)) else str(value)


def _differing_fields(headers: list[dict]) -> list[str]:
    """The header fields on which the parts' headers disagree, in the first header's order."""
    keys = list(dict.fromkeys(key for header in headers for key in header))
    return [key for key in keys if len({json.dumps(h.get(key), sort_keys=True) for h in headers}) > 1]


def _values(header: dict, fields: list[str]) -> str:
    """" (seed 5, flip_probability 0.5)": a part's values of the fields that differ (long fingerprints cut)."""
    if not fields:
        return ""
    shown = [f"{key} {str(header.get(key))[:16]}" for key in fields]
    return f" ({', '.join(shown)})"


def _redo_advice(token_dir: Path, parts: list[dict], groups: list[list[int]], world_size: int,
                 differing: list[str]) -> str:
    """What makes the merge work: keep the largest group of agreeing ranks (rank 0's on a tie), delete the other
    ranks' parts and the metas of their shards (a shard without its meta counts as unfinished, so a rerun redoes it
    instead of refusing its settings), and run those ranks again with the kept ranks' data and settings."""
    keep = max(groups, key=len)
    stale = sorted(rank for ranks in groups if ranks is not keep for rank in ranks)
    files = [token_dir / part_name(rank, world_size) for rank in stale]
    metas = [token_dir / f"{item['entry']['name']}.meta.json" for rank in stale for item in parts[rank]["shards"]]
    files += [path for path in metas if path.is_file()]
    listed = " ".join(str(path) for path in files[:MAX_LISTED_FILES])
    more = (f" and the other {len(files) - MAX_LISTED_FILES} shard metas their parts list" if len(files) >
            MAX_LISTED_FILES else "")
    kept = parts[keep[0]]["header"]
    like = ", ".join(f"{_FLAGS[key]} {_flag_value(kept.get(key))}" if key in _FLAGS
                     else f"{key} {str(kept.get(key))[:16]}" for key in differing) or "the same raw directory and settings"
    flags = f"--rank {stale[0]}" if len(stale) == 1 else "--rank R"
    others = f"rank {_ranks(stale)}" if len(stale) == 1 else f"ranks {_ranks(stale)}"
    return (f"To keep rank {_ranks(keep)}'s part: delete {listed}{more}; then run `train.py shards tokenize` for "
            f"{others} again ({flags} --world-size {world_size}) with {like}, as rank {_ranks(keep)} did (to keep "
            f"{others}'s instead, do the same for rank {_ranks(keep)})")


def merge_parts(token_dir: str | Path, world_size: int | None = None) -> dict:
    """Write `manifest.json` from the per-rank parts of a split tokenize; returns it. The same bytes as a
    one-process run writes: the same header, the shards in the raw manifest's order.

    `world_size`: which run's parts, needed only when parts of several world sizes are there. Raises ShardError,
    saying what to run, when a rank has not finished, when parts disagree (another raw directory, other settings,
    codes made on another device or dtype), or when a listed shard is no longer the one its rank finished.
    """
    token_dir = Path(token_dir)
    found: dict[int, dict[int, Path]] = {}
    for path in token_dir.glob("manifest.part-*-of-*.json"):
        match = _PART_NAME.match(path.name)
        if match:
            found.setdefault(int(match["world"]), {})[int(match["rank"])] = path
    if not found:
        raise ShardError(f"{token_dir}: no manifest parts (manifest.part-R-of-W.json): they are written by "
                         "`train.py shards tokenize` run with --world-size W > 1 on each rank R")
    if world_size is None:
        if len(found) > 1:
            raise ShardError(f"{token_dir}: manifest parts of runs with world sizes {_ranks(sorted(found))}; give "
                             "--world-size to say which run to merge")
        world_size = next(iter(found))
    paths = found.get(world_size, {})
    missing = [rank for rank in range(world_size) if rank not in paths]
    if missing:
        raise ShardError(f"{token_dir}: {ranks_of(missing, world_size)} not finished (no "
                         f"{part_name(missing[0], world_size)}); run `train.py shards tokenize` there with the same "
                         "--world-size (finished shards are skipped)")
    parts = []
    for rank in range(world_size):
        try:
            part = json.loads(paths[rank].read_text())
        except (OSError, ValueError) as err:
            raise ShardError(f"{paths[rank]}: unreadable manifest part ({err}); run rank {rank} again") from err
        if not isinstance(part, dict) or part.get("format") != PART_FORMAT:
            raise ShardError(f"{paths[rank]}: not a manifest part (format {PART_FORMAT!r}); run rank {rank} again")
        parts.append(part)
    for field, what in (("raw_manifest_sha256", "other raw shards (their raw manifests differ)"),
                        ("header", "other settings")):
        groups: dict[str, list[int]] = {}
        for rank, part in enumerate(parts):
            groups.setdefault(json.dumps(part.get(field), sort_keys=True), []).append(rank)
        if len(groups) > 1:
            headers = [parts[ranks[0]]["header"] for ranks in groups.values()]
            encoders = {" ".join(str(h.get(f)) for f in ENCODER_FIELDS) for h in headers}
            if field == "header" and len(encoders) > 1:
                what = f"images encoded on different devices or dtypes ({'; '.join(sorted(encoders))})"
            differing = _differing_fields(headers) if field == "header" else []
            split = "; ".join(f"rank {_ranks(ranks)}" + _values(parts[ranks[0]]["header"], differing)
                              for ranks in groups.values())
            raise ShardError(f"{token_dir}: the {world_size} ranks' parts were written for {what}: {split}. "
                             + _redo_advice(token_dir, parts, list(groups.values()), world_size, differing))
    entries: dict[int, dict] = {}
    for rank, part in enumerate(parts):
        for item in part["shards"]:
            entry = item["entry"]
            meta = read_shard_meta(token_dir, entry["name"])
            # the meta is written last and removed before a shard is redone: a rank still at work, or a later run,
            # shows here as a meta that is missing or no longer what this part recorded
            if meta is None or manifest_entry(meta) != entry:
                raise ShardError(f"{token_dir}: shard {entry['name']} is not the one rank {rank} finished (missing "
                                 f"or rewritten since); run rank {rank} of {world_size} again")
            if item["index"] in entries:
                raise ShardError(f"{token_dir}: raw shard {item['index']} is listed by two ranks' parts; run the "
                                 "ranks again with one --world-size")
            entries[item["index"]] = entry
    count = int(parts[0]["raw_shards"])
    if sorted(entries) != list(range(count)):
        raise ShardError(f"{token_dir}: the parts list {len(entries)} of the {count} raw shards; run every rank "
                         "again with one --world-size")
    return write_manifest(token_dir, parts[0]["header"], [entries[index] for index in range(count)])
