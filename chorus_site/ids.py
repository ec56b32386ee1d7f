"""Time-ordered UUIDs (the UUIDv7 layout of RFC 9562).

Primary keys sort by creation time, so one B-tree serves both lookups and keyset pagination,
and ids handed out over the API cannot be guessed from one another.
"""

import os
import time
import uuid


def uuid7() -> uuid.UUID:
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= ((rand >> 62) & 0xFFF) << 64  # 12 random bits
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)
    return uuid.UUID(int=value)
