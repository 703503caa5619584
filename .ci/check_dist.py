"""Check the built distributions' contents: python .ci/check_dist.py DIST_DIR (run from the checkout).

- the sdist holds every file git tracks: the tests read README.md, README.pypi.md, .ci/run, examples/
  and benchmarks/, so an sdist missing any of them fails its tests (MANIFEST.in lists what it ships);
- the wheel holds the package with ``py.typed`` and the license, and neither tests nor examples;
- both carry the SPDX license expression (metadata 2.4).

Prints one line per distribution; exits 1 with the missing or unexpected files named.
"""

from __future__ import annotations

import email
import glob
import os
import subprocess
import sys
import tarfile
import zipfile


def _tracked() -> set:
    out = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.decode()
    return {p for p in out.split("\0") if p}


def _one(dist_dir: str, pattern: str) -> str:
    found = glob.glob(os.path.join(dist_dir, pattern))
    if len(found) != 1:
        sys.exit(f"check_dist: expected one {pattern} in {dist_dir}, found {found}")
    return found[0]


def _license(metadata: str) -> str:
    return email.message_from_string(metadata).get("License-Expression", "")


def check(dist_dir: str) -> list:
    """The problems found (empty when both distributions are right)."""
    problems = []
    sdist = _one(dist_dir, "*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        root = names[0].split("/", 1)[0]
        shipped = {n.split("/", 1)[1] for n in names if "/" in n}
        pkg_info = tar.extractfile(f"{root}/PKG-INFO").read().decode()
    missing = sorted(_tracked() - shipped)
    if missing:
        problems.append(f"{os.path.basename(sdist)} lacks tracked files: {', '.join(missing)} (see MANIFEST.in)")
    if _license(pkg_info) != "Apache-2.0":
        problems.append(f"{os.path.basename(sdist)}: License-Expression is {_license(pkg_info)!r}, not 'Apache-2.0'")

    wheel = _one(dist_dir, "*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    need = {"lossscale/py.typed", "lossscale/__init__.py", "lossscale/cli.py"}
    if not need <= names:
        problems.append(f"{os.path.basename(wheel)} lacks {', '.join(sorted(need - names))}")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        problems.append(f"{os.path.basename(wheel)} lacks the LICENSE file")
    stray = sorted(n for n in names if n.split("/", 1)[0] in ("tests", "examples", "benchmarks", "docs"))
    if stray:
        problems.append(f"{os.path.basename(wheel)} ships non-package files: {', '.join(stray[:5])}")
    if _license(metadata) != "Apache-2.0":
        problems.append(f"{os.path.basename(wheel)}: License-Expression is {_license(metadata)!r}, not 'Apache-2.0'")
    if not problems:
        print(
            f"check_dist: {os.path.basename(sdist)} ships all {len(_tracked())} tracked files; "
            f"{os.path.basename(wheel)} has py.typed and LICENSE, no tests; License-Expression Apache-2.0 in both"
        )
    return problems


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python .ci/check_dist.py DIST_DIR")
    found = check(sys.argv[1])
    for line in found:
        print(f"check_dist: {line}", file=sys.stderr)
    sys.exit(1 if found else 0)
