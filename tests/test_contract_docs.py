"""docs/telemetry.md is the normative copy of tokentrace.contract: they must agree exactly."""

from __future__ import annotations

import re
from pathlib import Path

from tokentrace import contract

DOC = Path(__file__).resolve().parents[1] / "docs" / "telemetry.md"
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]*) \| ([^|]*) \| (.*) \|$")
HEADING = re.compile(r"^#{2,4} (?:span `([^`]+)`|event `([^`]+)` on `([^`]+)`|(Resource|Enums))")


def _doc_tables() -> dict[str, set[tuple[str, str, str]]]:
    """{section: {(key, type, unit)}} where section is a span name, 'event@span', or 'Resource'."""
    tables: dict[str, set[tuple[str, str, str]]] = {}
    section = ""
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = HEADING.match(line)
        if heading:
            span, event, carrier, other = heading.groups()
            section = span or (f"{event}@{carrier}" if event else other)
            tables.setdefault(section, set())
            continue
        row = ROW.match(line)
        if row and section not in ("Enums", ""):
            key, type_, unit, _ = (part.strip() for part in row.groups())
            tables[section].add((key, type_, unit))
    return tables


def _code_tables() -> dict[str, set[tuple[str, str, str]]]:
    tables = {"Resource": {(a.key, a.type, a.unit) for a in contract.RESOURCE}}
    for spec in contract.SPANS:
        tables[spec.name] = {(a.key, a.type, a.unit) for a in spec.attributes}
        for event in spec.events:
            tables[f"{event.name}@{spec.name}"] = {(a.key, a.type, a.unit) for a in event.attributes}
    return tables


def test_every_span_event_and_attribute_matches_the_doc():
    doc, code = _doc_tables(), _code_tables()
    doc.pop("Enums", None)
    assert sorted(doc) == sorted(code), "sections differ between docs/telemetry.md and contract.py"
    for section in code:
        assert doc[section] == code[section], f"{section}: doc {doc[section] ^ code[section]} differ"


def test_enums_match_the_doc():
    text = DOC.read_text(encoding="utf-8")
    enum_part = text.split("## Enums", 1)[1]
    documented = {}
    for line in enum_part.splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if match:
            documented[match.group(1)] = tuple(re.findall(r"`([^`]+)`", match.group(2)))
    assert documented == contract.ENUMS


def test_every_name_constant_is_specified():
    """A constant added to contract.py without a spec (and so without docs) is caught here."""
    specified = {spec.name for spec in contract.SPANS}
    specified |= {e.name for spec in contract.SPANS for e in spec.events}
    specified |= {a.key for spec in contract.SPANS for a in spec.attributes}
    specified |= {a.key for spec in contract.SPANS for e in spec.events for a in e.attributes}
    specified |= {a.key for a in contract.RESOURCE}
    specified |= {v for values in contract.ENUMS.values() for v in values}
    specified |= set(contract.UPSTREAM_EVIDENCE_KEYS)
    constants = {
        value
        for name, value in vars(contract).items()
        if name.isupper() and isinstance(value, str) and not name.startswith("DEFAULT")
    }
    assert constants - specified == set()


def test_upstream_evidence_keys_are_documented():
    """Keys inside ``tokentrace.upstream.evidence`` that the collector reads are listed in the doc."""
    part = DOC.read_text(encoding="utf-8").split("#### Keys of upstream evidence", 1)[1].split("\n#", 1)[0]
    documented = set(re.findall(r"^\| `([^`]+)` \|", part, re.M))
    assert documented == set(contract.UPSTREAM_EVIDENCE_KEYS)
