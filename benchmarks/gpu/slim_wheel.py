"""Rewrites a wheel without the files that match given patterns, with a RECORD that agrees.

    python benchmarks/gpu/slim_wheel.py WHEEL --drop 'bitsandbytes/libbitsandbytes_cuda1[12]*.so' ...

bitsandbytes ships one native library per CUDA version (43 MB for 0.50.2); the GPU machine needs only
the one matching its torch's CUDA, so fetch_wheels.sh keeps that one (and the CPU library) when the
carried set would pass its size limit. The wheel is replaced in place, keeping its name.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import tempfile
import zipfile
from pathlib import Path


def slim(wheel: Path, drop: list[str]) -> list[str]:
    """Removes the members matching any of ``drop`` (fnmatch patterns) and their RECORD lines; returns
    the removed names.

    Raises:
        ValueError: no member matched (a pattern that drops nothing is a mistake), or RECORD is missing.
    """
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
        removed = [n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in drop)]
        if not removed:
            raise ValueError(f"no file of {wheel.name} matches {drop}; "
                             "check the patterns against its contents")
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record is None:
            raise ValueError(f"{wheel.name} has no .dist-info/RECORD; it is not a wheel")
        fd, tmp = tempfile.mkstemp(suffix=".whl", dir=wheel.parent)
        os.close(fd)
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                if info.filename in removed:
                    continue
                data = source.read(info.filename)
                if info.filename == record:
                    keep = [line for line in data.decode().splitlines()
                            if line.split(",", 1)[0] not in removed]
                    data = ("\n".join(keep) + "\n").encode()
                target.writestr(info, data)
    os.replace(tmp, wheel)  # atomic: the wheel is either the old one or the complete new one
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--drop", action="append", required=True, help="fnmatch pattern of members to remove")
    args = parser.parse_args(argv)
    removed = slim(args.wheel, args.drop)
    print(f"{args.wheel.name}: removed {len(removed)} files, now {args.wheel.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
