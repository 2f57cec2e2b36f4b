"""Whether this install wrote a checkpoint: an HMAC of what in it can carry code, under a key of this install.

At every save rank 0 writes ``manifest.sig``: HMAC-SHA256 (RFC 2104, :mod:`hmac`) of ``manifest.json`` (the
sha256 of every file, checked before a load at ``train.verify_checkpoint=full``) and of every pickle inside
the checkpoint's torch files (the ``*.pkl`` records of each ``*.pt`` zip: the only parts of a checkpoint that
can run code when unpickled, tensors are raw bytes; vouched for at ``cheap`` too), keyed with 32 random bytes
kept outside the checkpoint: ``$XDG_CACHE_HOME/megahash/checkpoint.key`` (``~/.cache/megahash/``), created
0600 at the first save. :func:`written_here` recomputes it. The trainer uses it for one decision only:
a checkpoint whose DeepSpeed files need more than weights-only loading resumes without
``train.trust_checkpoint=true`` when this install wrote it (megahash/checkpoint/deepspeed_files.py).

It protects against resuming a checkpoint someone else made (downloaded, copied from a shared directory,
crafted) as if it were yours, and against a pickle changed after the save. It does not protect against
anyone who can read the key (your account, root, a backup of your home) or against code you run yourself,
and a run on another machine with another home directory does not share the key (it needs the flag).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import zipfile
from pathlib import Path

SIG_FILE = "manifest.sig"
MANIFEST = "manifest.json"


def key_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megahash" / "checkpoint.key"


def _key(create: bool) -> bytes | None:
    """This install's key; None when there is none (or it is readable by others: then it is no secret)."""
    path = key_path()
    if create and not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
        except FileExistsError:  # another process made it first
            pass
        except OSError:
            return None
    try:
        st = path.stat()
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            return None
        key = path.read_bytes()
    except OSError:
        return None
    return key if len(key) == 32 else None


def _digest(ckpt: Path, key: bytes) -> str | None:
    """The HMAC of the module docstring; None when a torch file is not a zip (nothing to vouch for)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update((Path(ckpt) / MANIFEST).read_bytes() if (Path(ckpt) / MANIFEST).is_file() else b"")
    for f in sorted(Path(ckpt).rglob("*.pt")):
        mac.update(b"\0" + str(f.relative_to(ckpt)).encode() + b"\0")
        try:
            with zipfile.ZipFile(f) as z:
                for name in sorted(n for n in z.namelist() if n.endswith(".pkl")):
                    mac.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
        except (zipfile.BadZipFile, OSError):
            return None
    return mac.hexdigest()


def sign(ckpt: Path) -> None:
    """Write ``ckpt/manifest.sig`` (rank 0, after the manifest). A save never fails for it: without a key
    (an unwritable home), the checkpoint is merely not known as this install's."""
    try:
        key = _key(create=True)
        digest = _digest(ckpt, key) if key else None
        if digest is not None:
            from megahash.atomic_write import write_text_atomic

            write_text_atomic(Path(ckpt) / SIG_FILE, digest + "\n")
    except Exception:  # (a zip member that does not read back: the manifest check names that file at resume)
        pass


def written_here(ckpt: Path) -> bool:
    """True when ``ckpt`` carries this install's signature over its present manifest and pickles."""
    key = _key(create=False)
    try:
        sig = (Path(ckpt) / SIG_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    digest = _digest(ckpt, key) if key else None
    return digest is not None and hmac.compare_digest(sig, digest)
