"""Atomic export: an artifact appears at --out complete, or --out is left as it was.

Export writes into a staging directory beside --out (same filesystem, so the final rename is atomic)
and renames it into place only after the manifest is written and verified. Ctrl-C and SIGTERM raise
ExportInterrupted in the exporting thread, so the `finally` that removes the staging directory runs.
A process that cannot clean up (SIGKILL, the out-of-memory killer, power loss) leaves a directory
whose name carries its host and pid; the next export beside the same --out removes those whose
process is gone.

Rules for an existing --out: a non-empty directory without manifest.json is never touched (it is not
ours); an artifact is replaced only with force; an empty directory is replaced.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import socket
import threading
from pathlib import Path

from onegraph.runtime.artifact import is_artifact

SEP = "+"                 # hostnames hold letters, digits, '-' and '.', never '+'


class ExportInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while exporting: the staging directory is removed, --out is untouched."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _temp_name(out: Path, kind: str) -> Path:
    return out.parent / SEP.join((f".{out.name}.onegraph-{kind}", socket.gethostname(), str(os.getpid()),
                                  secrets.token_hex(4)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:           # another user's live process
        return True
    return True


def stale_dirs(out: Path) -> list[Path]:
    """Staging / set-aside directories beside `out` left by exports on this host whose process is gone."""
    found = []
    if not out.parent.is_dir():
        return found
    prefixes = (f".{out.name}.onegraph-tmp{SEP}", f".{out.name}.onegraph-old{SEP}")
    host = socket.gethostname()
    for p in out.parent.iterdir():
        if not p.name.startswith(prefixes):
            continue
        parts = p.name.split(SEP)
        if len(parts) == 4 and parts[1] == host and parts[2].isdigit() and not _alive(int(parts[2])):
            found.append(p)
    return found


def check_target(out: Path, force: bool) -> None:
    """Refuse early (before any work) what publish() would refuse at the end."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory: refusing to overwrite it")
    if is_artifact(out):
        if not force:
            raise ValueError(f"--out {out} already holds an artifact: pass --force to replace it")
    elif any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not an onegraph artifact: refusing to overwrite it")


@contextlib.contextmanager
def staging(out: Path):
    """Yields a fresh staging directory beside `out`; it is removed on the way out unless publish() moved
    it. Stale ones left by dead exports are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in stale_dirs(out):
        shutil.rmtree(p, ignore_errors=True)
    stage = _temp_name(out, "tmp")
    stage.mkdir()
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)        # a no-op once published (renamed away)


@contextlib.contextmanager
def interruptible():
    """SIGTERM (and SIGINT) raise ExportInterrupted here, so cleanup runs; the old handlers come back
    after. An error that escapes after a signal came is that ExportInterrupted again: code running when it
    arrived may wrap it in its own error (torch.export's serializer wraps whatever its node handlers raise,
    here a module import the signal cut short). Outside the main thread signals cannot be handled: nothing
    is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []

    def raise_interrupted(signum, frame):
        came.append(signum)
        raise ExportInterrupted(signum)
    old = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except Exception:
        if came:
            raise ExportInterrupted(came[0]) from None
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def publish(stage: Path, out: Path, force: bool) -> None:
    """Rename the finished staging directory to `out`. An existing artifact (force) is first renamed
    aside and removed after; a concurrent export that publishes the same --out in between is handled
    by retrying, so with force the last one wins and without it the later one fails closed. SIGINT and
    SIGTERM wait until the renames are done (--out is never left missing by an interrupt)."""
    asides = []
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        while True:
            try:
                os.rename(stage, out)        # atomic; replaces an empty directory
                break
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            check_target(out, force)         # raises unless out is an artifact and force is set
            aside = _temp_name(out, "old")
            try:
                os.rename(out, aside)
            except FileNotFoundError:        # another export moved it first: try again
                continue
            asides.append(aside)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    for aside in asides:
        shutil.rmtree(aside, ignore_errors=True)
