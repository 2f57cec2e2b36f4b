"""A checkpoint's manifest and its verification.

Every save writes ``manifest.json`` (relative path -> bytes and sha256 of every file of the
checkpoint, DeepSpeed's and megatron's included; digest.py says who hashes what) before
``megahash_state.json``. :func:`damage` says why a checkpoint cannot be used, at one of two levels
(``train.verify_checkpoint``):

- ``cheap``: the state file is readable, every file of the manifest is there with its size, every
  torch ``.pt`` file is a readable zip (its central directory);
- ``full``: also the sha256 of every file against the manifest (a flipped byte of the same size).

A checkpoint without a manifest (older megahash, or the manifest removed) or with one of sizes only
(megahash before the digests) is not passed unchecked: its torch ``.pt`` files must be readable zips
(``cheap``) whose members match their CRC-32 (``full``: the checksums torch writes into the zip), and
:func:`unverified` names what could not be checked, for the callers' warning. A load that still fails
falls back like a damaged checkpoint (megahash/training/trainer.py).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from megahash.atomic_write import write_text_atomic
from megahash.checkpoint import digest
from megahash.checkpoint.layout import EMA_DIR, STATE_FILE, WEIGHTS_DIR, read_json
from megahash.checkpoint.origin import SIG_FILE  # the signature of the manifest: not in it

MANIFEST = "manifest.json"
LEVELS = ("cheap", "full")  # train.verify_checkpoint
FORMAT = 2  # 1 (implicit): {"files": {path: bytes}}; 2: {"files": {path: {"bytes", "sha256"}}}
# what evaluation and export read of a checkpoint (model/, ema/, the config): all they verify
INFERENCE_SCOPE = (WEIGHTS_DIR, EMA_DIR, "resolved_config.yaml")


def _listed(p: Path) -> bool:
    return (
        p.is_file()
        and p.name not in (MANIFEST, STATE_FILE, SIG_FILE)
        and ".tmp-" not in p.name
        and not digest.is_sidecar(p.name)
    )


def write_manifest(ckpt: Path, hashes: bool = True) -> None:
    """Record bytes and sha256 of every file under ``ckpt`` (rank 0, after every rank has written):
    the digests the ranks left in their sidecars, the rest hashed here (``hashes=False``: sizes only,
    as megahash wrote manifests before the digests; a benchmark's baseline)."""
    known = digest.take_sidecars(ckpt)
    files, rest = {}, []
    for p in sorted(ckpt.rglob("*")):
        if not _listed(p):
            continue
        rel, size = str(p.relative_to(ckpt)), p.stat().st_size
        if not hashes:
            files[rel] = size
        elif known.get(rel, (None,))[0] == size:
            files[rel] = {"bytes": size, digest.ALGORITHM: known[rel][1]}
        else:
            rest.append(p)
    for p, (size, hexdigest) in digest.digests(rest).items():
        files[str(p.relative_to(ckpt))] = {"bytes": size, digest.ALGORITHM: hexdigest}
    if not hashes:
        write_text_atomic(ckpt / MANIFEST, json.dumps({"files": files}, indent=0))
        return
    body = {"format": FORMAT, "algorithm": digest.ALGORITHM, "files": dict(sorted(files.items()))}
    write_text_atomic(ckpt / MANIFEST, json.dumps(body, indent=0))


def read_manifest(ckpt: Path) -> dict[str, dict] | None:
    """Relative path -> {"bytes": n[, "sha256": hex]} of ``ckpt``'s manifest (None: it has none).
    Raises OSError/ValueError/KeyError/TypeError when it is unreadable."""
    man = ckpt / MANIFEST
    if not man.is_file():
        return None
    body = read_json(man)  # a JSON object (nested past the recursion limit, a list: ValueError)
    files = body["files"]
    return {rel: entry if isinstance(entry, dict) else {"bytes": int(entry)} for rel, entry in files.items()}


def unverified(ckpt: Path) -> str | None:
    """What the manifest of ``ckpt`` cannot vouch for (None: every file has its digest)."""
    try:
        files = read_manifest(ckpt)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damage() reports it
    if files is None:
        return f"it has no {MANIFEST} (saved by an older megahash, or the manifest was removed)"
    if any(digest.ALGORITHM not in e for e in files.values()):
        return f"its {MANIFEST} records sizes only (saved by an older megahash)"
    return None


def _in_scope(rel: str, scope) -> bool:
    return scope is None or rel.split("/", 1)[0] in scope


def damage(ckpt: Path, level: str = "cheap", share: tuple[int, int] = (0, 1), scope=None) -> str | None:
    """Why ``ckpt`` cannot be used (None if it is intact) at ``level`` (cheap | full). ``share``:
    (rank, world) when several ranks verify it together: this rank hashes its part of the files
    (digest.share), the callers combine the answers. ``scope``: the top-level names checked (None:
    all; evaluation and export: :data:`INFERENCE_SCOPE`)."""
    try:
        state = read_json(ckpt / STATE_FILE)
        int(state["step"])
    except FileNotFoundError:
        return f"it has no {STATE_FILE} (an unfinished save)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {STATE_FILE} is unreadable ({type(e).__name__})"
    try:
        files = read_manifest(ckpt)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    if files is None:  # no manifest: what the files themselves can tell
        files = {str(p.relative_to(ckpt)): {} for p in sorted(ckpt.rglob("*")) if _listed(p)}
    files = {rel: e for rel, e in files.items() if _in_scope(rel, scope)}
    for rel, entry in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"{rel} is missing"
        got = p.stat().st_size
        if "bytes" in entry and got != entry["bytes"]:
            return f"{rel} has {got} bytes, {entry['bytes']} were written"
        if p.suffix == ".pt" and (why := _zip_damage(p, crc=False)):
            return f"{rel} {why}"
    if level != "full":
        return None
    sizes = {rel: (ckpt / rel).stat().st_size for rel in files}
    unhashed = [rel for rel, e in files.items() if digest.ALGORITHM not in e and rel.endswith(".pt")]
    for rel in digest.share({rel: sizes[rel] for rel in unhashed}, *share):  # no digest: torch's zip CRC-32
        if why := _zip_damage(ckpt / rel, crc=True):
            return f"{rel} {why}"
    hashed = {rel: e for rel, e in files.items() if digest.ALGORITHM in e}
    mine = digest.share({rel: sizes[rel] for rel in hashed}, *share)
    try:
        got = digest.digests([ckpt / rel for rel in mine])
    except OSError as e:
        return f"{Path(e.filename or '?').name} cannot be read ({e.strerror})"
    for rel in mine:
        if got[ckpt / rel][1] != hashed[rel][digest.ALGORITHM]:
            return f"{rel} is not the file that was saved (its {digest.ALGORITHM} differs from the manifest's)"
    return None


def _zip_damage(p: Path, crc: bool) -> str | None:
    """Why a torch ``.pt`` file is not a readable zip (``crc``: also each member's CRC-32, a full read)."""
    try:
        with zipfile.ZipFile(p) as z:
            z.infolist()
            bad = z.testzip() if crc else None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"is not a readable torch file ({e})"
    return f"fails the zip checksum of its member {bad}" if bad else None
