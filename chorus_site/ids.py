"""Time-ordered UUIDs (the UUIDv7 layout of RFC 9562).

Primary keys sort by creation time, so one B-tree serves both lookups and keyset pagination,
and ids handed out over the API cannot be guessed from one another.
"""

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last = [0, 0]  # (millis, rand) of the previous id of this process


def uuid7() -> uuid.UUID:
    """Within one process ids strictly increase, also within one millisecond (RFC 9562 §6.2,
    method 2): rows created together (the nodes of a workflow) keep their creation order."""
    with _lock:
        millis = time.time_ns() // 1_000_000
        # 74 bits of randomness, the top one clear: room to count up within a millisecond.
        rand = int.from_bytes(os.urandom(10), "big") & ((1 << 73) - 1)
        if millis <= _last[0]:
            millis = _last[0]
            rand = _last[1] + 1 + (rand & 0xFFFF)  # increment by a random step
            if rand >> 74:  # 74 random bits used below: overflow moves to the next millisecond
                millis, rand = millis + 1, rand & 0xFFFF
        _last[0], _last[1] = millis, rand
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= ((rand >> 62) & 0xFFF) << 64  # 12 high bits of the counter/random part
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)
    return uuid.UUID(int=value)


def short_id(value) -> str:
    """The part of an id to show people: its random tail.

    The head of a time-ordered id is its creation time, so ids made within a second share their
    first 8 characters; the last 8 hex digits come from the random (counter) bits and differ.
    """
    return "…" + str(value)[-8:] if value else "–"
