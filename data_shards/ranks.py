"""Which shards each process takes: the disjoint split by rank, and the rank and world size a launcher gives."""

from __future__ import annotations

import os


def rank_subset(names: list[str], rank: int, world_size: int) -> set[str]:
    """The names process `rank` of `world_size` handles: every world_size-th of the sorted names, from `rank`
    (disjoint across ranks, together all of them, the same in every process)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}: need world size >= 1 and 0 <= rank < world size")
    return set(sorted(names)[rank::world_size])


# Where a launcher says which process this is: torchrun, then SLURM (srun sets one task per process).
LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))


def process_split(rank: int | None = None, world_size: int | None = None,
                  environ: dict | None = None) -> tuple[int, int, str]:
    """(rank, world size, where they came from): the flags when given, else torchrun's RANK/WORLD_SIZE, else
    SLURM's SLURM_PROCID/SLURM_NTASKS, else one process (0 of 1). Raises ValueError for a half or invalid split."""
    environ = os.environ if environ is None else environ
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError("give --rank and --world-size together (or neither, to read torchrun's or SLURM's)")
        source = "--rank/--world-size"
    else:
        found = next(((r, w) for r, w in LAUNCHER_VARIABLES if r in environ and w in environ), None)
        if found is None:
            return 0, 1, "one process"
        source = f"{found[0]}/{found[1]}"
        try:
            rank, world_size = int(environ[found[0]]), int(environ[found[1]])
        except ValueError as err:
            raise ValueError(f"{source} from the environment are not integers ({err}); give --rank and "
                             "--world-size") from err
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} (from {source}): need a world size >= 1 and "
                         "0 <= rank < world size")
    return rank, world_size, source
