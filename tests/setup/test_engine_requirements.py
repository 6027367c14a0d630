"""Our requirements can be met beside sglang 0.5.23's and vLLM 0.33.0's own.

The engines are installed with `--no-deps` (scripts/setup_env.sh), so pip never weighs their declared
requirements against ours; here they are read from the installed metadata (`Requires-Dist`, markers
evaluated for this platform, extras-only requirements left out). For every package that we (any
requirement of spec-schema or spec-runtime, the `engines` extra first) and at least one engine name,
some version, the installed one or one the package index offers, must satisfy all three specifiers.
Where sglang and vLLM contradict each other (no version satisfies both), that is the engines' own
conflict: both cannot be installed with their dependencies in one environment anyway. Ours must then
agree with one of them, and the conflict is recorded in ENGINE_CONFLICTS (a new or vanished one fails).
The index is asked only for packages whose installed version satisfies not all (`pip index versions`:
a few seconds each).
"""

import functools
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from tests.features import missing

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {"sglang": "0.5.23", "vllm": "0.33.0"}
# The engines' own conflicts: package -> the engines whose requirement ours can be met with.
# torch: sglang pins 2.14.1, vLLM 2.14.0 (our torch>=2.4 meets either; the tests run the CPU 2.13.0
# with the engines' heavy modules faked). openai: sglang pins 2.8.0, vLLM needs >=2.25.0; the
# `engines` extra follows vLLM (sglang's modules the tests import work with it).
ENGINE_CONFLICTS = {"torch": ("sglang", "vllm"), "openai": ("vllm",)}


def normalize(name: str) -> str:
    """The PEP 503 form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def applies(req: Requirement) -> bool:
    """True when `req` holds on this platform outside any extra."""
    return req.marker is None or req.marker.evaluate({"extra": ""})


def specifiers(requirements: list[str]) -> dict[str, SpecifierSet]:
    """{normalized name: the specifiers of all of `requirements` that apply here, joined}."""
    found: dict[str, SpecifierSet] = {}
    for line in requirements:
        req = Requirement(line)
        if applies(req):
            name = normalize(req.name)
            found[name] = found.get(name, SpecifierSet()) & req.specifier
    return found


def ours() -> dict[str, SpecifierSet]:
    """Every requirement of both distributions, the extras' included (spec-schema's own name left out)."""
    lines = []
    for path in (ROOT / "schema" / "pyproject.toml", ROOT / "pyproject.toml"):
        project = tomllib.loads(path.read_text())["project"]
        lines += project.get("dependencies", [])
        lines += [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
    found = specifiers(lines)
    found.pop("spec-schema", None)
    return found


def engine_requirements(name: str) -> dict[str, SpecifierSet]:
    """The installed engine's own requirements, as `specifiers` joins them."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError as err:
        missing(name, err, "install the 'engines' extra (bash scripts/setup_env.sh runtime,test,engines)")
    assert dist.version == ENGINES[name], f"{name} {dist.version} is installed; the tests know {ENGINES[name]}"
    return specifiers(dist.requires or [])


@functools.cache
def index_versions(name: str) -> tuple[Version, ...]:
    """The versions of `name` the configured package index offers (`pip index versions`)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True,
                         text=True, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("Available versions:")), None)
    assert line is not None, f"pip index versions {name} listed nothing:\n{out.stdout}{out.stderr[-2000:]}"
    return tuple(Version(v) for v in line.split(":", 1)[1].replace(" ", "").split(","))


def installed_version(name: str) -> tuple[Version, ...]:
    try:
        return (Version(metadata.version(name)),)
    except (metadata.PackageNotFoundError, InvalidVersion):
        return ()


def satisfiable(name: str, *sets: SpecifierSet) -> bool:
    """Some version of `name`, installed or on the index, meets every one of `sets`."""
    joined = SpecifierSet()
    for s in sets:
        joined &= s
    if any(joined.contains(v, prereleases=True) for v in installed_version(name)):
        return True
    return any(True for _ in joined.filter(index_versions(name)))


def test_specifier_sets_are_joined_per_package() -> None:
    """The reading itself: markers for this platform, extras-only lines left out, specifiers joined."""
    found = specifiers(["a.b>=1", "A_B<3", "b==1; extra == 'x'", "c; sys_platform == 'no-such-os'", "d[fast]==2"])
    assert found == {"a-b": SpecifierSet(">=1,<3"), "d": SpecifierSet("==2")}
    assert satisfiable("pytest", SpecifierSet(f"=={metadata.version('pytest')}"), SpecifierSet(">=8"))


def test_our_requirements_meet_sglang_and_vllm() -> None:
    """Every package we and an engine both require: one version meets ours and both engines', or the
    engines contradict each other (ENGINE_CONFLICTS) and ours meets one of them."""
    engines = {name: engine_requirements(name) for name in ENGINES}
    conflicts, broken = {}, []
    for name, mine in sorted(ours().items()):
        theirs = {engine: reqs[name] for engine, reqs in engines.items() if name in reqs}
        if not theirs or satisfiable(name, mine, *theirs.values()):
            continue
        if satisfiable(name, *theirs.values()):
            broken.append(f"{name}: ours {mine or 'any'} against " +
                          ", ".join(f"{e} {s or 'any'}" for e, s in theirs.items()))
            continue
        conflicts[name] = tuple(e for e, s in theirs.items() if satisfiable(name, mine, s))
        if not conflicts[name]:
            broken.append(f"{name}: ours {mine} meets neither engine ({theirs})")
    assert not broken, "our requirements contradict the engines': " + "; ".join(broken)
    assert conflicts == ENGINE_CONFLICTS, f"the engines' own conflicts changed: {conflicts}"
