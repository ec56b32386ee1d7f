"""Maintained secret detectors against our canary corpus and ordinary operations text (issue 8, item 4).

    .venv/bin/python bench/redaction_detectors.py --gitleaks PATH/config/gitleaks.toml [--write]

Compares, on the canaries of tests/chorus_site/test_redaction.py (CANARIES + NEW_CANARIES) and on
ordinary operations text (its ORDINARY table, plus this repository's ``git log --stat``, docs and
``pip freeze``):

* detect-secrets' plugins (all of them, as ``scan_line`` runs them), if the package is importable
  (``pip install detect-secrets`` in a scratch venv and put it on PYTHONPATH: it is no dependency);
* gitleaks' default rule list (config/gitleaks.toml, MIT), used as data: regex, secretGroup,
  entropy, keywords and the global value allowlist;
* ours (agents/redaction_rules.py), which includes the adopted gitleaks rules.

A canary counts as detected when its secrets are covered by the detector's findings; a false
positive is any finding in an ordinary text.  ``--write`` regenerates agents/gitleaks_rules.json
from the toml: every rule that compiles in Python, minus EXCLUDED (rules with false positives on
the ordinary corpus).  Prints JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "agents" / "gitleaks_rules.json"
# generic-api-key: 4 findings in the ordinary corpus ("Idempotency-Key: enforce-limit-1", prose);
# our own keyword rule covers NAME=value with stricter checks.
EXCLUDED = {"generic-api-key"}


def go_to_python(regex: str) -> str:
    """Go RE2 → Python re: a ``(?i)`` after the start applies to the rest of its group; ``\\z``."""
    while (k := regex.find("(?i)", 1)) >= 0:
        depth, j, in_class = 0, k + 4, False
        while j < len(regex):
            c = regex[j]
            if c == "\\":
                j += 2
                continue
            if in_class:
                in_class = c != "]"
            elif c == "[":
                in_class = True
            elif c == "(":
                depth += 1
            elif c == ")":
                if depth == 0:
                    break
                depth -= 1
            j += 1
        regex = regex[:k] + "(?i:" + regex[k + 4:j] + ")" + regex[j:]
    return regex.replace("\\z", "\\Z").replace("[[:alnum:]]", "[A-Za-z0-9]")


def load_gitleaks(path: str) -> tuple[list[dict], list[str], list[tuple[str, str]]]:
    config = tomllib.loads(Path(path).read_text())
    rules, refused = [], []
    for rule in config["rules"]:
        if "regex" not in rule:
            continue
        regex = go_to_python(rule["regex"])
        try:
            re.compile(regex)
        except re.error as exc:
            refused.append((rule["id"], str(exc)))
            continue
        rules.append({"id": rule["id"], "regex": regex, "group": rule.get("secretGroup", 0),
                      "entropy": rule.get("entropy"), "keywords": [k.lower() for k in rule.get("keywords", [])]})
    allow = [go_to_python(r) for r in config.get("allowlist", {}).get("regexes", [])]
    return rules, allow, refused


def entropy(text: str) -> float:
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values()) if n else 0.0


def gitleaks_findings(rules, allow, text: str):
    compiled = [(r, re.compile(r["regex"])) for r in rules]
    allowed = [re.compile(a) for a in allow]
    low = text.lower()
    for rule, regex in compiled:
        if rule["keywords"] and not any(k in low for k in rule["keywords"]):
            continue
        for match in regex.finditer(text):
            group = rule["group"] or next((i for i in range(1, (match.lastindex or 0) + 1) if match.group(i)), 0)
            secret = match.group(group)
            if not secret or (rule["entropy"] and entropy(secret) < rule["entropy"]):
                continue
            if any(a.search(secret) for a in allowed):
                continue
            yield match.start(group), match.end(group), rule["id"]


def detect_secrets_findings(text: str):
    from detect_secrets.core.scan import scan_line
    from detect_secrets.settings import default_settings

    with default_settings():
        start = 0
        for line in text.split("\n"):
            for found in scan_line(line):
                for match in re.finditer(re.escape(found.secret_value or "\0"), line):
                    yield start + match.start(), start + match.end(), found.type
            start += len(line) + 1


def covers(text: str, spans, secret: str) -> bool:
    at = text.find(secret)
    while at >= 0:
        hit = [False] * len(secret)
        for a, b, _ in spans:
            for k in range(max(a, at), min(b, at + len(secret))):
                hit[k - at] = True
        if sum(hit) < len(secret) - 3:
            return False
        at = text.find(secret, at + 1)
    return True


def ordinary_corpus(table: list[str]) -> list[str]:
    log = subprocess.run(["git", "-C", str(ROOT), "log", "--stat", "-400"], capture_output=True, text=True).stdout
    texts = list(table) + [log[i:i + 4000] for i in range(0, len(log), 4000)]
    texts += [Path(p).read_text() for p in sorted(glob.glob(str(ROOT / "docs" / "*.md"))) + [str(ROOT / "README.md")]]
    texts.append(subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout)
    return texts


def evaluate(findings, canaries, ordinary) -> dict:
    # A secret not in clear (base64, wrapped over lines) is missed by a detector that does not decode.
    missed = [cid for cid, text, secrets in canaries
              if not all(s in text and covers(text, list(findings(text)), s) for s in secrets)]
    false = Counter(f[2] for text in ordinary for f in findings(text))
    return {"detected": len(canaries) - len(missed), "canaries": len(canaries), "missed": missed,
            "ordinary_texts_hit": sum(1 for text in ordinary if any(True for _ in findings(text))),
            "false_positives_by_rule": dict(false)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gitleaks", required=True, help="path of gitleaks' config/gitleaks.toml")
    parser.add_argument("--write", action="store_true", help=f"regenerate {OUT.relative_to(ROOT)}")
    parser.add_argument("--commit", default="", help="the gitleaks commit the toml comes from (recorded)")
    args = parser.parse_args()
    rules, allow, refused = load_gitleaks(args.gitleaks)
    adopted = [r for r in rules if r["id"] not in EXCLUDED]
    if args.write:
        OUT.write_text(json.dumps({"source": "gitleaks config/gitleaks.toml (MIT licence), converted by "
                                             "bench/redaction_detectors.py", "commit": args.commit, "excluded": sorted(EXCLUDED),
                                   "allowlist": allow, "rules": adopted}, indent=0) + "\n")
    from agents.redaction_rules import redact
    from tests.chorus_site import test_redaction as table

    canaries = table.CANARIES + table.NEW_CANARIES
    ordinary = ordinary_corpus(table.ORDINARY)
    report = {"canaries": len(canaries), "ordinary_texts": len(ordinary),
              "gitleaks": {"rules": len(rules), "not_compiled": refused,
                           **evaluate(lambda t: gitleaks_findings(rules, allow, t), canaries, ordinary)},
              "gitleaks_adopted": evaluate(lambda t: gitleaks_findings(adopted, allow, t), canaries, ordinary)}
    try:
        report["detect_secrets"] = evaluate(lambda t: list(detect_secrets_findings(t)), canaries, ordinary)
    except ImportError:
        report["detect_secrets"] = "not importable"

    missed = []
    for cid, text, secrets in canaries:
        try:
            table.assert_masked(redact(text), *secrets)
        except AssertionError:
            missed.append(cid)
    report["ours"] = {"detected": len(canaries) - len(missed), "missed": missed,
                      "ordinary_texts_altered": [t[:80] for t in ordinary if redact(t) != t]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
