"""How long redaction takes on one long instruction (issue 11: a 300,000-character text).

    python bench/redact_long_text.py [CHARS ...]

Prints seconds per kind of text: one letter repeated, a random URL-safe token (a long run of word
characters, the worst case for patterns with a leading "[\\w.-]{0,N}"), words, and symbols.
"""

from __future__ import annotations

import os
import secrets
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chorus_site.settings")

import django  # noqa: E402

django.setup()

from chorus_site.redaction import redact  # noqa: E402


def main(sizes: list[int]) -> None:
    print("chars     letter   token    words    symbols  (seconds)")
    for n in sizes:
        texts = ["x" * n, secrets.token_urlsafe(n * 3 // 4 + 1)[:n], ("word " * (n // 5 + 1))[:n],
                 ("ab/+=" * (n // 5 + 1))[:n]]
        times = []
        for text in texts:
            start = time.perf_counter()
            redact(text)
            times.append(time.perf_counter() - start)
        print(f"{n:<9} " + " ".join(f"{t:<8.3f}" for t in times))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [20_000, 40_000, 300_000])
