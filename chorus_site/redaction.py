"""Secret masking applied before diagnostics, events and exports are stored (SPEC §7).

The rules live in ``agents.redaction_rules`` so that the daemon masks with the same rules before
it spools a report; this module is the portal's name for them.  ``ingest`` is what every entry
point applies to the text it stores (daemon reports, agents' talk-back): strings made storable
(NUL and lone surrogates → U+FFFD) and redacted, keys named like secrets masked.
"""

from __future__ import annotations

from agents.redaction_rules import (  # noqa: F401 — re-exported
    MASK, REPLACEMENT, StreamRedactor, clean_text, ingest, redact, redact_data, redact_structure,
)
