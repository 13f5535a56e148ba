"""The lock of the quick start and CI: ``constraints.txt``, exact versions of
every package ``.[all,test]`` installs (pip, setuptools and torch included),
the ones the whole suite last passed with.

``python dev/lock.py diff``  prints each package whose installed version
                             differs from the lock (exit 0 either way);
``python dev/lock.py write`` writes the environment's versions as the lock
                             (``make lock``, after ``make test-latest`` passed).

A local version label (torch's ``+cpu``) is dropped: the lock names the
release, and the platform's build of it satisfies it.
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

LOCK = Path(__file__).resolve().parents[1] / "constraints.txt"
HEADER = """\
# The lock: exact versions of every package `.[all,test]` installs, the ones
# the whole suite last passed with. `make install` (so `make demo`, `make test`
# and .ci/run) installs through it; pyproject.toml keeps the ranges. Update it
# with `make test-latest` then `make lock` (docs/development.md).
"""
#: The project itself: installed editable, never locked.
OWN = {"graphrunner"}


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> str:
    """``version`` without its local label (``2.13.0+cpu`` -> ``2.13.0``)."""
    return version.split("+", 1)[0]


def installed() -> dict[str, str]:
    """Every distribution installed in this environment but the project:
    name -> release. Only the environment's own site-packages count, not
    whatever else is on ``sys.path`` (setuptools puts its vendored packages
    there when it is imported)."""
    paths = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    found: dict[str, str] = {}
    for dist in metadata.distributions(path=paths):
        name = canonical(dist.metadata["Name"])
        if name not in OWN:
            found[name] = release(dist.version)
    return found


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """The lock's ``name==version`` lines: name -> version."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{path}:{number}: {raw!r} is not 'name==version'")
        pins[canonical(name.strip())] = version.strip()
    return pins


def differences(pins: dict[str, str], have: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, locked, installed) for each package whose version differs; a
    missing side reads '-'."""
    names = sorted(set(pins) | set(have))
    rows = [(n, pins.get(n, "-"), have.get(n, "-")) for n in names]
    return [row for row in rows if row[1] != row[2]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["diff", "write"])
    args = parser.parse_args(argv)
    have = installed()
    if args.command == "write":
        lines = [f"{name}=={version}" for name, version in sorted(have.items())]
        LOCK.write_text(HEADER + "\n".join(lines) + "\n")
        print(f"wrote {len(lines)} versions to {LOCK.name}")
        return 0
    rows = differences(read_lock(), have)
    if not rows:
        print(f"every installed version equals {LOCK.name}")
        return 0
    width = max(len(r[0]) for r in rows)
    print(f"{len(rows)} packages differ from {LOCK.name}:")
    print(f"  {'package':<{width}}  {'locked':>14}  {'installed':>14}")
    for name, locked, got in rows:
        print(f"  {name:<{width}}  {locked:>14}  {got:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
