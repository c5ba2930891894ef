"""Per-prompt results as JSON Lines, appended as each one finishes.

Each record is keyed by prompt id, turn, method and the hash of the settings, so a run that
was interrupted picks up where it stopped: finished records are kept and skipped, and none
is written twice. A record cut short by the interruption (a partial last line) is dropped
when the file is opened and that unit runs again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def record_key(prompt_id: str, turn: int, method: str, config_hash: str) -> str:
    return f"{prompt_id}/{turn}/{method}/{config_hash}"


class ResultStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._records: dict[str, Record] = {}
        self.dropped_lines = 0  # unreadable or duplicate lines removed when the file was opened
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        raw = self.path.read_text(encoding="utf-8")
        for line in raw.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self.dropped_lines += 1
                continue
            if not isinstance(record, dict) or "key" not in record or record["key"] in self._records:
                self.dropped_lines += 1
                continue
            self._records[record["key"]] = record
        if self.dropped_lines or (raw and not raw.endswith("\n")):
            self._rewrite()

    def _rewrite(self) -> None:
        """Replace the file with the good records only (atomically, so a second interruption
        cannot lose what the first one left)."""
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("w", encoding="utf-8") as f:
            for record in self._records.values():
                f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        partial.replace(self.path)

    def get(self, key: str) -> Record | None:
        return self._records.get(key)

    def append(self, record: Record) -> None:
        if record["key"] in self._records:
            raise ValueError(f"result {record['key']} is already stored")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._records[record["key"]] = record

    def records(self, config_hash: str | None = None) -> list[Record]:
        """Stored records in the order they were written, optionally of one configuration."""
        return [r for r in self._records.values() if config_hash is None or r.get("config_hash") == config_hash]

    def __len__(self) -> int:
        return len(self._records)
