"""The conversation target mask of a token shard (`NAME.targets.npy`): its bits, and the check against the ids.

A shard holding at least one conversation (chat SFT data) also has `NAME.targets.npy`: uint8, one entry per id,
bit 0 (`TARGET`) = the token is a training target, bit 1 (`CONVERSATION`) = it belongs to a conversation, which
packing never cuts. Plain documents there are all 1; a conversation's prompt and context tokens (`<s>`, system and
user turns with their `<sep>`) are 2, its trained roles' turns (with the `</s>` ending each answer) 3. Shards
without conversations have no such file (every token is a target). The mask is stored, not derived from the ids,
because the markers alone cannot tell a system turn from a user turn (`<sep>` ends both), so a run training one of
them could not be told from the ids, and because a shard mixing documents and conversations needs a per-document
"never cut" flag. It is checksummed in the meta's `files` like the others, and `verify_shard` checks it against
the markers and the recorded `target_roles` (`first_mismatch`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

TARGETS_FILE = ".targets.npy"  # shards with conversations: uint8 per id, the bits below
TARGET = 1  # bit 0 of a targets entry: the token is a training target
CONVERSATION = 2  # bit 1: the token belongs to a conversation (packing never cuts it)


def first_mismatch(ids: np.ndarray, marks: np.ndarray, offsets: np.ndarray, sep_id: int, eos_id: int,
                   target_roles: Iterable[str]) -> int | None:
    """The first position (id of the shard) where the target mask `marks` disagrees with the ids' markers and the
    trained roles, or None: the conversation bit constant within each document, plain documents all `TARGET`, and
    in a conversation `<s>` never a target, each turn (ended by `<sep>`, or by `</s>` for the assistant's, marker
    included) entirely a target or not as its role is trained. `offsets`: the shard's (documents + 1 entries)."""
    ids = np.asarray(ids, dtype=np.int64)
    marks = np.asarray(marks)
    n = len(ids)
    lengths = np.diff(offsets)
    doc_of = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), lengths)
    starts = offsets[:-1][lengths > 0]
    conv = (marks & CONVERSATION) != 0
    target = (marks & TARGET) != 0
    bad = np.zeros(n, dtype=bool)
    bad |= marks > (TARGET | CONVERSATION)
    bad |= conv != conv[offsets[:-1][doc_of]]  # the conversation bit is its document's first token's
    bad |= ~conv & ~target  # a plain document is a target everywhere
    # turns: a new segment at each document start, right after `<s>` and right after each end of turn
    is_end = (ids == sep_id) | (ids == eos_id)
    begins = np.zeros(n, dtype=bool)
    begins[starts] = True
    after_start = starts + 1
    begins[after_start[after_start < n]] = True
    begins[1:] |= is_end[:-1]
    segment = np.cumsum(begins) - 1
    first = np.flatnonzero(begins)
    last = np.concatenate([first[1:], [n]]) - 1
    roles = set(target_roles)
    others = len(roles & {"system", "user"})  # 0: no <sep> turn trained, 2: all, 1: each turn all or nothing
    kind = np.where(ids[last] == eos_id, 1, np.where(ids[last] == sep_id, 2, 0))  # answer / other / neither
    kind[np.isin(first, starts)] = 0  # `<s>` (a document's first token) is never a target
    expected = np.where(kind == 1, int("assistant" in roles), np.where(kind == 2, -1 if others == 1 else
                                                                        int(others == 2), 0))
    lowest = np.minimum.reduceat(target.astype(np.int8), first)
    highest = np.maximum.reduceat(target.astype(np.int8), first)
    wrong = np.where(expected < 0, lowest != highest, (lowest != expected) | (highest != expected))
    bad |= conv & wrong[segment]
    return int(np.flatnonzero(bad)[0]) if bad.any() else None
