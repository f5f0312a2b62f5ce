"""A self-contained demonstration of the bisect on any machine: a local wheelhouse of small
packages and a GOOD and a BAD requirement set between which `memhog` grows from 10 MB to
200 MB at import, while other packages change too (`jointa`/`jointb` 2.0 require each other,
so a candidate with only one of them is inconsistent; `gadget` is added, `relic` removed).

    python -m envcheck.bisect.demo DIR     # then run the `launcher.py bisect` line it prints
    python -m envcheck.bisect.demo --coupled DIR

`--coupled` writes the set that real GPU stacks look like: packages whose versions pin each
other (`plug 2.0` requires `core==2.0`, `plug 1.0` requires `core==1.0`), a chain (`app`
requires `lib==x`, `lib` requires `base>=y`), a pair coupled in one direction only (`opt 2.0`
requires `util>=2.0`, `opt 1.0` does not care), an added package that `plug 2.0` requires and a
removed one that `plug 1.0` requires. The culprit (200 MB at import, `core` unless told
otherwise) can sit inside a coupled group.

Wheels are written directly (a wheel is a zip with METADATA, WHEEL and RECORD), which takes
milliseconds and needs no build backend. The tests and `benchmarks/bench_bisect.py` use it.
"""
from __future__ import annotations

import base64
import hashlib
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from launcher_core.fileio import write_json_atomic, write_text_atomic

IMPORTED = ("memhog", "alpha", "beta", "zulu")   # present in every candidate: the probe imports them


@dataclass(frozen=True)
class DemoPackage:
    name: str
    version: str
    ballast_mib: int = 1                        # allocated (and touched) at import
    requires: tuple[str, ...] = ()


GOOD = (DemoPackage("memhog", "1.0", 10), DemoPackage("alpha", "1.0"), DemoPackage("beta", "1.0"),
        DemoPackage("jointa", "1.0"), DemoPackage("jointb", "1.0"), DemoPackage("relic", "0.9"),
        DemoPackage("zulu", "3.0"), DemoPackage("steady", "1.0"))
BAD = (DemoPackage("memhog", "2.0", 200), DemoPackage("alpha", "1.1", 2), DemoPackage("beta", "2.0"),
       DemoPackage("jointa", "2.0", requires=("jointb==2.0",)),
       DemoPackage("jointb", "2.0", requires=("jointa==2.0",)),
       DemoPackage("gadget", "0.1"), DemoPackage("zulu", "3.1", 3), DemoPackage("steady", "1.0"))


COUPLED_CHANGED = ("app", "base", "core", "foo", "lib", "opt", "plug", "util")   # in GOOD and BAD
COUPLED_IMPORTED = (*COUPLED_CHANGED, "steady")


def coupled_sets(culprit: str = "core") -> tuple[tuple[DemoPackage, ...], tuple[DemoPackage, ...]]:
    """GOOD and BAD of the coupled demo; `culprit`'s BAD version allocates 200 MB at import."""
    if culprit not in COUPLED_CHANGED:
        raise ValueError(f"culprit {culprit!r}: choose one of {', '.join(COUPLED_CHANGED)} "
                         "(a package in both sets, so every candidate can import it)")
    good = (DemoPackage("core", "1.0"), DemoPackage("plug", "1.0", requires=("core==1.0", "relic>=0.9")),
            DemoPackage("app", "1.0", requires=("lib==1.0",)), DemoPackage("lib", "1.0", requires=("base>=1.0",)),
            DemoPackage("base", "1.0"), DemoPackage("opt", "1.0"), DemoPackage("util", "1.0"),
            DemoPackage("foo", "1.0"), DemoPackage("relic", "0.9"), DemoPackage("steady", "1.0"))
    bad = (DemoPackage("core", "2.0"), DemoPackage("plug", "2.0", requires=("core==2.0", "gadget>=0.1")),
           DemoPackage("app", "2.0", requires=("lib==2.0",)), DemoPackage("lib", "2.0", requires=("base>=2.0",)),
           DemoPackage("base", "2.0"), DemoPackage("opt", "2.0", requires=("util>=2.0",)),
           DemoPackage("util", "2.0"), DemoPackage("foo", "1.1"), DemoPackage("gadget", "0.1"),
           DemoPackage("steady", "1.0"))
    return _with_ballast(good, culprit, 10), _with_ballast(bad, culprit, 200)


def _with_ballast(packages: tuple[DemoPackage, ...], name: str, mib: int) -> tuple[DemoPackage, ...]:
    return tuple(DemoPackage(p.name, p.version, mib, p.requires) if p.name == name else p for p in packages)


@dataclass(frozen=True)
class Demo:
    wheelhouse: Path
    good: Path
    bad: Path


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def wheel_files(package: DemoPackage) -> dict[str, bytes]:
    """The files of a pure-python wheel for `package`, RECORD included."""
    info = f"{package.name}-{package.version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {package.name}\nVersion: {package.version}\n"
    metadata += "".join(f"Requires-Dist: {requirement}\n" for requirement in package.requires)
    files = {
        f"{package.name}/__init__.py": (f"__version__ = {package.version!r}\n"
                                        f"_BALLAST = bytearray(b'\\x01') * ({package.ballast_mib} * 1024 * 1024)\n").encode(),
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: envcheck-demo\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(path, data) for path, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    return files


def build_wheel(directory: Path, package: DemoPackage) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{package.name}-{package.version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in wheel_files(package).items():
            archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return path


def build_demo(directory: Path) -> Demo:
    """Wheelhouse + GOOD (pip freeze text) + BAD (snapshot JSON) under `directory`."""
    wheelhouse = build_wheelhouse(directory / "wheelhouse", GOOD + BAD)
    good = write_text_atomic(directory / "good-freeze.txt",
                             "".join(f"{package.name}=={package.version}\n" for package in GOOD))
    bad = write_json_atomic(directory / "bad-snapshot.json",
                            {"packages": {package.name: package.version for package in BAD}})
    return Demo(wheelhouse, good, bad)


def build_wheelhouse(directory: Path, packages: tuple[DemoPackage, ...]) -> Path:
    for package in set(packages):
        build_wheel(directory, package)
    return directory


def build_coupled_demo(directory: Path, culprit: str = "core") -> Demo:
    """Wheelhouse + GOOD and BAD requirements files of the coupled demo under `directory`."""
    good, bad = coupled_sets(culprit)
    wheelhouse = build_wheelhouse(directory / "wheelhouse", good + bad)
    return Demo(wheelhouse, write_text_atomic(directory / "good.txt", _pins_text(good)),
                write_text_atomic(directory / "bad.txt", _pins_text(bad)))


def _pins_text(packages: tuple[DemoPackage, ...]) -> str:
    return "".join(f"{package.name}=={package.version}\n" for package in packages)


def demo_probe(imported: tuple[str, ...] = IMPORTED) -> str:
    return "{python} launcher.py probe --import " + ",".join(imported)


def main(argv: list[str]) -> int:
    coupled = argv[:1] == ["--coupled"]
    argv = argv[1:] if coupled else argv
    if len(argv) != 1:
        print("usage: python -m envcheck.bisect.demo [--coupled] DIR", file=sys.stderr)
        return 2
    root = Path(argv[0]).resolve()
    demo = build_coupled_demo(root) if coupled else build_demo(root)
    probe = demo_probe(COUPLED_IMPORTED if coupled else IMPORTED)
    print(json.dumps({"wheelhouse": str(demo.wheelhouse), "good": str(demo.good), "bad": str(demo.bad)}, indent=2))
    print(f"python launcher.py bisect --good {demo.good} --bad {demo.bad} --find-links {demo.wheelhouse} "
          f"--no-index --offline --work-dir {root / 'bisect'} --probe '{probe}'")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
