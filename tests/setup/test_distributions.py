"""Two distributions from this repository, one version: `spec-schema` (spec_schema alone, the engines'
plugin entry points) and `spec-runtime` (spec_runtime, spec_kernels, spec_train and the `spec-runtime`
command, on spec-schema). `scripts/check_dists.sh` builds each sdist, then each wheel from its sdist,
installs spec-schema alone into a clean venv and runs tests/schema there; the tests below read what it
left. It needs `build` and the package index (a CPU torch from the same wheel as the main set-up):
about 1.5 minutes of CPU, several of wall time on a loaded 2-core machine, so scripts/test.sh runs
this file beside the main run.
"""

import ast
import configparser
import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import tomllib
from tests.features import missing

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = {"sglang.srt.plugins": {"spec_schema": "spec_schema.engines.sglang_plugin:register"},
           "vllm.general_plugins": {"spec_schema": "spec_schema.engines.vllm_plugin:register"}}
PACKAGES = {"spec_schema": {"spec_schema"}, "spec_runtime": {"spec_runtime", "spec_kernels", "spec_train"}}


def version() -> str:
    """spec_schema.__version__, read as setuptools reads it (statically): the one version of both."""
    tree = ast.parse((ROOT / "src" / "spec_schema" / "__init__.py").read_text())
    return next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "__version__")


def test_one_version_for_both_distributions() -> None:
    for path in (ROOT / "schema" / "pyproject.toml", ROOT / "pyproject.toml"):
        config = tomllib.loads(path.read_text())
        assert "version" not in config["project"] and "version" in config["project"]["dynamic"], path
        assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "spec_schema.__version__"}, path
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"spec-schema=={version()}" in runtime["dependencies"], "spec-runtime pins another spec-schema"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """scripts/check_dists.sh's run: its output and its OUT directory."""
    try:
        import build  # noqa: F401
    except ImportError as err:
        missing("build", err, "install the 'test' extra")
    out = tmp_path_factory.mktemp("dists")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "check_dists.sh"), str(out)], capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "PYTHON": sys.executable})
    (out / "log").write_text(proc.stdout + proc.stderr)
    return proc, out


def _dist(built, name: str, kind: str) -> Path:
    proc, out = built
    path = out / "dist" / (f"{name}-{version()}-py3-none-any.whl" if kind == "wheel" else f"{name}-{version()}.tar.gz")
    assert path.is_file(), f"check_dists.sh made no {path.name}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return path


def _wheel_text(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = f"{wheel.name.split('-')[0]}-{version()}.dist-info/{member}"
        return z.read(name).decode() if name in z.namelist() else ""


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_each_wheel_is_built_from_its_sdist_and_holds_its_packages(built, name) -> None:
    wheel, sdist = _dist(built, name, "wheel"), _dist(built, name, "sdist")
    assert (built[1] / "log").read_text().count("Building wheel from sdist") == 2
    with zipfile.ZipFile(wheel) as z:
        files = [f for f in z.namelist() if ".dist-info/" not in f]
    assert {f.split("/")[0] for f in files} == PACKAGES[name]
    assert all(f"{pkg}/py.typed" in files for pkg in PACKAGES[name])
    if name == "spec_runtime":  # package data: the training prompts, the decisions shipped per GPU
        assert {"spec_train/prompts_mix.jsonl", "spec_kernels/tuned/nvidia-h200.json"} <= set(files)
    with tarfile.open(sdist) as t:
        sources = {m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile() and "/" in m.name}
    packages = {s.split("/")[1] for s in sources if s.startswith("src/") and ".egg-info/" not in s}
    assert not [s for s in sources if s.startswith("tests/")], "an sdist ships tests"
    # spec-runtime's version is spec_schema.__version__: that one file travels in its sdist.
    assert packages == PACKAGES[name] | ({"spec_schema"} if name == "spec_runtime" else set())
    if name == "spec_runtime":
        assert [s for s in sources if s.startswith("src/spec_schema/")] == ["src/spec_schema/__init__.py"]


def test_the_engine_plugins_are_spec_schema_entry_points_only(built) -> None:
    def entry_points(name: str) -> dict[str, dict[str, str]]:
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str
        parser.read_string(_wheel_text(_dist(built, name, "wheel"), "entry_points.txt"))
        return {group: dict(parser[group]) for group in parser.sections()}

    assert entry_points("spec_schema") == PLUGINS
    assert entry_points("spec_runtime") == {"console_scripts": {"spec-runtime": "spec_runtime.cli:main"}}


def test_spec_schema_needs_four_packages_and_spec_runtime_needs_spec_schema(built) -> None:
    def requires(name: str) -> list[str]:
        meta = Parser().parsestr(_wheel_text(_dist(built, name, "wheel"), "METADATA"))
        return [r for r in meta.get_all("Requires-Dist", []) if "extra ==" not in r]

    assert sorted(r.split(">")[0] for r in requires("spec_schema")) == ["beartype", "jaxtyping", "pydantic", "torch"]
    assert requires("spec_runtime") == [f"spec-schema=={version()}"]


def test_schema_tests_pass_against_spec_schema_installed_alone(built) -> None:
    proc, out = built
    assert proc.returncode == 0, f"check_dists.sh failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout

    def venv(code: str) -> str:  # the clean venv's own view: no PYTHONPATH of this process
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        return subprocess.run([str(out / "venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                              check=True, env=env).stdout

    site = venv("import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    assert (out / "where").read_text().strip() == f"{site}/spec_schema/__init__.py"
    names = venv("import importlib.metadata as m; print(*(d.metadata['Name'] for d in m.distributions()))").split()
    assert "spec-schema" in names and "spec-runtime" not in names
