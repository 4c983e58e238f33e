"""Carry a Triton cache compiled on this machine (`spark-bench kernels --triton-cache DIR`, same Triton version as the
GPU machine) to the GPU check, small enough for the device tool's 64 MiB.

    python tests/gpu/triton_cache.py pack DIR .triton-cache.tar.xz    # here: keep each kernel's cubin and metadata
    python tests/gpu/triton_cache.py unpack .triton-cache.tar.xz DIR  # there: before the first Triton call

A cache hit needs only the metadata JSON, the cubin and the group file (the JIT keeps the group's files that exist);
the group file names its files by absolute path, so `unpack` rewrites those paths to DIR. Whether the GPU's JIT then
finds them (same cache key: Triton and ptxas versions, source, signature, attributes, options, cache-invalidating
environment variables) is what run_gpu_check.sh counts.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

KEEP = (".json", ".cubin")


def pack(src: str, archive: str) -> None:
    root = Path(src)
    count = 0
    with tarfile.open(archive, "w:xz") as tar:
        for entry in sorted(p for p in root.iterdir() if p.is_dir()):
            for f in sorted(entry.iterdir()):
                if f.name.startswith("__grp__"):
                    group = json.loads(f.read_text())
                    group["child_paths"] = {k: Path(v).name for k, v in group["child_paths"].items()
                                            if Path(v).suffix in KEEP}
                    data = json.dumps(group).encode()
                    info = tarfile.TarInfo(f"{entry.name}/{f.name}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                    count += 1
                elif f.suffix in KEEP:
                    tar.add(f, arcname=f"{entry.name}/{f.name}")
    print(f"{count} kernels packed into {archive} ({Path(archive).stat().st_size / 2**20:.1f} MiB)")


def unpack(archive: str, dest: str) -> None:
    root = Path(dest).resolve()
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(root, filter="data")
    count = 0
    for grp in root.glob("*/__grp__*"):
        group = json.loads(grp.read_text())
        group["child_paths"] = {k: str(grp.parent / Path(v).name) for k, v in group["child_paths"].items()}
        grp.write_text(json.dumps(group))
        count += 1
    print(f"{count} kernels unpacked into {root}")


def main(argv: list[str]) -> None:
    """One line and exit 2 for a wrong command line or a missing source (before any archive or folder is made)."""
    problem = None
    if len(argv) != 3 or argv[0] not in ("pack", "unpack"):
        problem = "usage: triton_cache.py pack DIR ARCHIVE | unpack ARCHIVE DIR"
    elif not (Path(argv[1]).is_dir() if argv[0] == "pack" else Path(argv[1]).is_file()):
        problem = f"triton_cache.py {argv[0]}: {argv[1]}: no such {'folder' if argv[0] == 'pack' else 'file'}"
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    {"pack": pack, "unpack": unpack}[argv[0]](argv[1], argv[2])


if __name__ == "__main__":
    main(sys.argv[1:])
