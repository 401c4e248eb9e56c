"""Saved sessions on disk (`serve --state-dir DIR`): one snapshot file and one manifest each.

    DIR/<session id>.safetensors   the snapshot bytes (runtime/snapshot.py's format)
    DIR/<session id>.json          manifest: {"format", "session_id", "bytes", "sha256", "saved_at"}
    DIR/refused/                   entries that could not be restored, moved aside with the reason

Writes are atomic: each file is written under a temporary name, flushed and renamed, the
snapshot first and the manifest last, so an entry exists only once both are whole; a crash
mid-write leaves a temporary file that the next `entries` ignores. `read` checks the manifest's
size and sha256 before anyone parses the bytes. Nothing here knows tensors: the bytes are opaque.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = "worldserve.state/1"
DATA = ".safetensors"
MANIFEST = ".json"


class StoreError(Exception):
    """A saved entry that cannot be read (missing, damaged, another format); `reason` as
    `runtime.snapshot.SnapshotError`'s ("damaged", "version")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Entry:
    """One saved session's manifest."""

    session_id: str
    nbytes: int
    sha256: str
    saved_at: float


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StateStore:
    """A directory of saved sessions (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _paths(self, session_id: str) -> tuple[Path, Path]:
        if not session_id or any(c in session_id for c in "/\\.") or session_id.startswith("-"):
            raise ValueError(f"not a session id: {session_id!r}")
        return self.root / f"{session_id}{DATA}", self.root / f"{session_id}{MANIFEST}"

    def write(self, session_id: str, data: bytes) -> Entry:
        """Save one session's snapshot bytes (replacing an older save of it)."""
        data_path, manifest_path = self._paths(session_id)
        entry = Entry(session_id, len(data), hashlib.sha256(data).hexdigest(), time.time())
        _atomic_write(data_path, data)
        manifest = {"format": FORMAT, **entry.__dict__}
        _atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
        return entry

    def entries(self) -> list[str]:
        """Ids of the saved sessions (those with a manifest), oldest save first."""
        found = []
        for path in self.root.glob(f"*{MANIFEST}"):
            if path.name.startswith("."):
                continue
            with contextlib.suppress(OSError):
                found.append((path.stat().st_mtime, path.stem))
        return [sid for _, sid in sorted(found)]

    def read(self, session_id: str) -> bytes:
        """A saved session's bytes, checked against its manifest (`StoreError` otherwise)."""
        data_path, manifest_path = self._paths(session_id)
        try:
            manifest = json.loads(manifest_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise StoreError("damaged", f"{manifest_path.name}: unreadable manifest: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            got = manifest.get("format") if isinstance(manifest, dict) else None
            raise StoreError("version", f"{manifest_path.name}: format {got!r}, this server reads {FORMAT!r}")
        try:
            data = data_path.read_bytes()
        except OSError as exc:
            raise StoreError("damaged", f"{data_path.name}: {exc.strerror or exc}") from exc
        if len(data) != manifest.get("nbytes") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
            raise StoreError("damaged", f"{data_path.name}: size or sha256 does not match its manifest")
        return data

    def size(self, session_id: str) -> int:
        """Bytes of a saved session's snapshot file (OSError when absent)."""
        return self._paths(session_id)[0].stat().st_size

    def remove(self, session_id: str) -> None:
        """Forget a saved session (no-op when absent)."""
        for path in self._paths(session_id):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def refuse(self, session_id: str, reason: str) -> Path:
        """Move an entry that cannot be restored to DIR/refused/ with a note of why (kept for a
        person to look at; never restored again); returns that folder."""
        aside = self.root / "refused"
        aside.mkdir(exist_ok=True)
        for path in self._paths(session_id):
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, aside / path.name)
        (aside / f"{session_id}.reason.txt").write_text(reason + "\n")
        return aside
