"""Redis Cluster hash slots, and ids made to land in a chosen one.

Redis Cluster stores a key in slot CRC16(tag) mod 16384, where the tag is the part of the key
between the first `{` and the next `}` (or the whole key). A session's keys carry its id as their
tag (`agents:s:{<id>}:meta`), so a session lives in the slot of its id. A script may touch keys of
one slot only; so that a session's script can also touch its share of the global indexes, those
are split into shards (store/keys.py), each shard's keys tagged so that they share one slot, and a
session id is made to land in the slot of a shard (`id_in_slot`): then a session and its shard's
indexes are one slot. A sub-agent's child gets an id in its parent's slot, a fork one in its
origin's, so that a session tree shares a slot (a budget's claims span the tree).

CRC16 here is CRC-16/XMODEM, which `binascii.crc_hqx` computes. It is linear: the CRC of
`base + suffix` is the CRC of `base` carried through as many zero bytes, XOR the CRC of the suffix
alone. So a suffix that brings `base` to a given slot is found with two small tables instead of a
search over ids.
"""

from __future__ import annotations

from binascii import crc_hqx
from functools import cache

#: hash slots of a Redis Cluster
SLOTS = 16384
_MASK = SLOTS - 1
#: hex characters of a suffix: 2 chosen among 256, then 3 looked up among 4096
_HEAD, _TAIL = 2, 3
SUFFIX = _HEAD + _TAIL


def tag_slot(tag: str) -> int:
    """The slot of keys whose hash tag is `tag` (or of the key `tag` when it has no `{…}`)."""
    return crc_hqx(tag.encode(), 0) & _MASK


def key_slot(key: str) -> int:
    """The slot of a key, as Redis Cluster computes it (hash tag rules included)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return tag_slot(key[start + 1 : end])
    return tag_slot(key)


@cache
def _tails() -> dict[int, bytes]:
    """3-hex-character suffixes by the low 14 bits of their CRC (from zero)."""
    out: dict[int, bytes] = {}
    for i in range(16**_TAIL):
        text = b"%03x" % i
        out.setdefault(crc_hqx(text, 0) & _MASK, text)
    return out


_ZEROS = bytes(_TAIL)


def id_in_slot(base: str, slot: int) -> str:
    """`base` followed by 5 hex characters chosen so that the whole lands in `slot`; the same
    base and slot give the same id. ValueError in the (never seen) case that none does."""
    tails = _tails()
    start = crc_hqx(base.encode(), 0)
    for i in range(16**_HEAD):
        head = b"%02x" % i
        carried = crc_hqx(_ZEROS, crc_hqx(head, start))
        tail = tails.get((slot ^ carried) & _MASK)
        if tail is not None:
            return base + (head + tail).decode()
    raise ValueError(f"no 5-character suffix brings {base!r} to slot {slot}")


@cache
def shard_slots(count: int) -> tuple[int, ...]:
    """The slot of each of `count` shards: the middle of its share of the slot range, so that the
    shards spread evenly over the primaries of a cluster made with `redis-cli --cluster create`
    (which gives each primary an equal range)."""
    width = SLOTS / count
    return tuple(int(width * n + width / 2) for n in range(count))


@cache
def shard_tags(count: int) -> tuple[str, ...]:
    """The hash tag of each of `count` shards' keys (`shard<n>-<5 hex>`), in that shard's slot."""
    return tuple(id_in_slot(f"shard{n}-", s) for n, s in enumerate(shard_slots(count)))


@cache
def slot_shards(count: int) -> dict[int, int]:
    """Shard number by slot, for the slots of `count` shards."""
    return {s: n for n, s in enumerate(shard_slots(count))}
