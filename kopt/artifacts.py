"""Content-addressed artifact store: bytes kept out of workflow history, referenced by sha256.

The local directory store is the embedded default; in production every worker mounts the same
directory (a shared volume). An S3-compatible store would implement the same three methods.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from kopt.models import ArtifactRef


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def put_bytes(self, data: bytes) -> ArtifactRef:
        sha = hashlib.sha256(data).hexdigest()
        path = self._path(sha)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename: a crash never leaves a truncated artifact under its final name.
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        return ArtifactRef(sha256=sha, size=len(data), uri=f"file://{path}")

    def put_file(self, path: Path) -> ArtifactRef:
        return self.put_bytes(Path(path).read_bytes())

    def get_bytes(self, ref: ArtifactRef) -> bytes:
        path = self._path(ref.sha256)
        if not path.is_file():
            raise FileNotFoundError(f"artifact {ref.sha256[:12]} not in store {self.root}")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise ValueError(f"artifact {ref.sha256[:12]} is corrupt in store {self.root}")
        return data

    def materialize(self, ref: ArtifactRef, dest: Path) -> Path:
        """Copy an artifact to dest (idempotent; content-addressed names make this safe)."""
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dest.parent)
            with os.fdopen(fd, "wb") as fh:
                fh.write(self.get_bytes(ref))
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest)
        return dest

    # Kernel packages travel as a deterministic tar of the package folder.
    def put_tree(self, folder: Path) -> ArtifactRef:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    info = tar.gettarinfo(str(path), arcname=str(path.relative_to(folder)))
                    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                    with path.open("rb") as fh:
                        tar.addfile(info, fh)
        return self.put_bytes(buf.getvalue())

    def unpack_tree(self, ref: ArtifactRef, cache: Path) -> Path:
        dest = cache / ref.sha256
        if not dest.is_dir():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
            with tarfile.open(fileobj=io.BytesIO(self.get_bytes(ref))) as tar:
                tar.extractall(tmp, filter="data")
            _readable_by_all(tmp)  # the sandboxed harness reads it as an unprivileged user
            try:
                os.replace(tmp, dest)
            except OSError:  # another worker unpacked it first
                shutil.rmtree(tmp, ignore_errors=True)
        if dest.stat().st_mode & 0o005 != 0o005:  # unpacked by an older kopt, private
            _readable_by_all(dest)
        return dest


def _readable_by_all(folder: Path) -> None:
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
