"""hub.py against real huggingface_hub calls: a hand-built HF cache (offline) and a local fake Hub (online)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError
from rich.console import Console

from dflash_cli.errors import DflashError
from dflash_cli.loading import hub
from dflash_cli.loading.hub import check_disk_space, plan_download, pull, resolve_model_dir
from dflash_cli.setup.recipes import ModelRef
from helpers.tiny_models import make_hf_cache

REPO = "tiny-org/tiny-qwen3"
SHA = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[2]


def recording_console() -> Console:
    return Console(file=StringIO(), record=True, width=400)


@pytest.fixture
def repo_with_extras(tiny_qwen3_dir: Path, tmp_path: Path) -> Path:
    """The tiny model plus files a real repo has and dflash must not fetch: pickles, `original/`, README."""
    src = tmp_path / "repo"
    shutil.copytree(tiny_qwen3_dir, src)
    (src / "pytorch_model.bin").write_bytes(b"pickle" * 100)
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"pickle" * 100)
    (src / "README.md").write_text("# tiny")
    return src


# ---- local directories ----------------------------------------------------------------------------------------


def test_local_directory_is_returned_as_is(tiny_qwen3_dir: Path) -> None:
    assert resolve_model_dir(str(tiny_qwen3_dir)) == tiny_qwen3_dir.resolve()


def test_local_directory_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(DflashError, match="no config.json"):
        resolve_model_dir(str(tmp_path), what="target")


def test_local_file_and_missing_path_are_refused(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DflashError, match="is a file") as info:
        resolve_model_dir(str(tiny_qwen3_dir / "config.json"))
    assert str(tiny_qwen3_dir) in info.value.fix
    with pytest.raises(DflashError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))


def test_bad_repo_id_is_refused(offline: Path) -> None:
    with pytest.raises(DflashError, match="neither a local directory nor a Hugging Face repo id"):
        resolve_model_dir("not a repo!")


def test_local_pickle_only_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(DflashError, match="pickle") as info:
        resolve_model_dir(str(tmp_path))
    assert "pytorch_model.bin" in info.value.message


# ---- offline, from a hand-built cache -----------------------------------------------------------------------


def test_offline_cached_repo_resolves_to_its_snapshot(offline: Path, tiny_qwen3_dir: Path) -> None:
    snapshot = make_hf_cache(offline, REPO, tiny_qwen3_dir, sha=SHA)
    path = resolve_model_dir(REPO)
    assert path == snapshot
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


def test_offline_revision_pinning(offline: Path, tiny_qwen3_dir: Path, tiny_llama_dir: Path) -> None:
    make_hf_cache(offline, REPO, tiny_qwen3_dir, sha=SHA)
    other = "89abcdef0123456789abcdef0123456789abcdef"
    make_hf_cache(offline, REPO, tiny_llama_dir, sha=other, revision="v2")
    assert resolve_model_dir(REPO).name == SHA
    assert resolve_model_dir(REPO, revision="v2").name == other
    assert resolve_model_dir(REPO, revision=other).name == other
    with pytest.raises(DflashError, match="revision v3") as info:
        resolve_model_dir(REPO, revision="v3")
    assert "dflash pull --target tiny-org/tiny-qwen3 --revision v3" in info.value.fix


def test_offline_not_cached_is_one_clear_error(offline: Path) -> None:
    with pytest.raises(DflashError) as info:
        resolve_model_dir("Qwen/Qwen3-8B", what="target")
    err = info.value
    assert "target Qwen/Qwen3-8B" in err.message and "HF_HUB_OFFLINE=1" in err.message
    assert str(offline / "hub") in err.message
    assert "dflash pull qwen3-8b`" in err.fix and "local model directory" in err.fix  # the recipe: drafter too
    assert "unset HF_HUB_OFFLINE" in err.fix


def test_the_pull_command_names_the_recipe_that_uses_a_repo() -> None:
    assert hub.pull_command("Qwen/Qwen3-8B") == "dflash pull qwen3-8b"
    assert hub.pull_command("z-lab/Qwen3-8B-DFlash-b16") == "dflash pull qwen3-8b"  # as a drafter
    assert hub.pull_command("someone/model") == "dflash pull --target someone/model"
    assert hub.pull_command("Qwen/Qwen3-8B", "abc") == "dflash pull --target Qwen/Qwen3-8B --revision abc"
    assert hub.pull_command("someone/drafter", what="drafter") == "hf download someone/drafter"  # (no recipe's)


def test_a_recipe_name_given_as_a_model_is_pointed_at_the_recipe(offline: Path) -> None:
    """`--target demoo` (a typo of a recipe's name, which --target and `dflash train --target` take too) is no
    ORG/NAME repo id: the fix names the recipe, and says nothing of where a name goes."""
    with pytest.raises(DflashError) as info:
        resolve_model_dir("demoo", what="target")
    assert info.value.fix.startswith("did you mean the recipe demo? the recipes: `dflash recipes list`")
    with pytest.raises(DflashError) as info:
        resolve_model_dir("someone/model", what="target")
    assert "did you mean" not in info.value.fix and "without --target" not in info.value.fix


def test_a_missing_path_and_a_training_runs_folder_are_pointed_at(
    offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--drafter runs/nonexist` (one slash: a repo id's shape) that is neither here nor cached says what the
    folder holds as a path too; a `dflash train` output folder given as the drafter points at its drafter."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo2" / "drafter").mkdir(parents=True)
    (tmp_path / "runs" / "demo2" / "drafter" / "config.json").write_text("{}")
    with pytest.raises(DflashError) as info:
        resolve_model_dir("runs/nonexist", what="drafter")
    assert info.value.fix.startswith("as a path: runs holds no nonexist (`ls runs`); as a repo id:")
    with pytest.raises(DflashError) as info:
        resolve_model_dir("runs/demo2", what="drafter")
    assert "has no config.json" in info.value.message
    assert info.value.fix == "pass runs/demo2/drafter: the drafter of that training run"
    with pytest.raises(DflashError) as info:
        resolve_model_dir("someone/model", what="drafter")
    assert "as a path" not in info.value.fix


@pytest.mark.slow
def test_offline_not_cached_in_a_clean_process_has_no_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = (
        "from dflash_cli.loading.hub import resolve_model_dir\n"
        "from dflash_cli.errors import DflashError\n"
        "try:\n    resolve_model_dir('Qwen/Qwen3-8B')\n"
        "except DflashError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Qwen/Qwen3-8B" in proc.stdout and "HF_HUB_OFFLINE=1" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_offline_cached_without_weights_names_what_is_missing(
    offline: Path, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(tiny_qwen3_dir, partial)
    (partial / "model.safetensors").unlink()
    make_hf_cache(offline, REPO, partial, sha=SHA)
    with pytest.raises(DflashError, match=r"no \*\.safetensors weights"):
        resolve_model_dir(REPO)


def test_offline_cached_pickle_only_repo_is_refused(offline: Path, tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_qwen3_dir / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"x")
    make_hf_cache(offline, REPO, pickled, sha=SHA)
    with pytest.raises(DflashError, match="only as pickle files"):
        resolve_model_dir(REPO)


def test_offline_plan_describes_the_cache(offline: Path, tiny_qwen3_dir: Path) -> None:
    make_hf_cache(offline, REPO, tiny_qwen3_dir, sha=SHA)
    plan = plan_download(REPO)
    sizes = {p.name: p.stat().st_size for p in tiny_qwen3_dir.iterdir()}
    assert {f.name: f.size for f in plan.files} == sizes
    assert plan.download_bytes == 0 and plan.total_bytes == sum(sizes.values())
    assert plan.commit == SHA


@pytest.fixture
def unreachable_hub(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode, but the Hub endpoint refuses connections (a closed local port)."""
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    url_template = "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)


def test_unreachable_hub_not_cached(unreachable_hub: None) -> None:
    with pytest.raises(DflashError, match="huggingface.co cannot be reached") as info:
        resolve_model_dir(REPO, progress=False)
    assert "check the network" in info.value.fix


def test_unreachable_hub_uses_the_cache(unreachable_hub: None, hf_home: Path, tiny_qwen3_dir: Path) -> None:
    snapshot = make_hf_cache(hf_home, REPO, tiny_qwen3_dir, sha=SHA)
    assert resolve_model_dir(REPO) == snapshot
    console = recording_console()
    [plan] = pull([REPO], console)
    assert plan.path == str(snapshot) and "everything is cached" in console.export_text()


# ---- online, against the fake Hub -----------------------------------------------------------------------------


def test_download_fetches_only_safe_files_and_then_uses_the_cache(
    fake_hub, hf_home: Path, repo_with_extras: Path, tiny_qwen3_dir: Path
) -> None:
    served = fake_hub.add_repo(REPO, repo_with_extras, sha=SHA)
    path = resolve_model_dir(REPO, progress=False)
    assert path == hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA
    fetched = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert fetched == sorted(p.name for p in tiny_qwen3_dir.iterdir())  # no pickles, no original/, no README
    assert (path / "model.safetensors").read_bytes() == (repo_with_extras / "model.safetensors").read_bytes()
    requests = len(served.requests)
    assert resolve_model_dir(REPO, progress=False) == path
    assert len(served.requests) == requests  # the complete cached snapshot needs no network


def test_plan_download_lists_sizes_and_what_is_cached(fake_hub, hf_home: Path, repo_with_extras: Path) -> None:
    fake_hub.add_repo(REPO, repo_with_extras, sha=SHA)
    plan = plan_download(REPO)
    names = {f.name for f in plan.files}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names and "README.md" not in names
    assert not any(n.startswith("original/") for n in names)
    weights = (repo_with_extras / "model.safetensors").stat().st_size
    assert plan.download_bytes == plan.total_bytes >= weights
    assert plan.commit == SHA
    resolve_model_dir(REPO, progress=False)
    again = plan_download(REPO)
    assert again.total_bytes == plan.total_bytes and again.download_bytes == 0


def test_pull_dry_run_shows_total_and_downloads_nothing(fake_hub, hf_home: Path, tiny_qwen3_dir: Path) -> None:
    served = fake_hub.add_repo(REPO, tiny_qwen3_dir, sha=SHA)
    console = recording_console()
    [plan] = pull([REPO], console, dry_run=True)
    text = console.export_text()
    assert REPO in text and "to download" in text and "finished files are kept" in text
    assert not any(r.startswith("GET") and "/resolve/" in r for r in served.requests)
    assert plan.path is None


def test_pull_downloads_with_a_progress_bar(fake_hub, hf_home: Path, tiny_qwen3_dir: Path) -> None:
    fake_hub.add_repo(REPO, tiny_qwen3_dir, sha=SHA)
    console = recording_console()
    [plan] = pull([REPO], console)
    text = console.export_text()
    assert f"{REPO} ready in" in text
    assert Path(plan.path, "model.safetensors").is_file()


def test_pull_json_prints_the_plans(fake_hub, hf_home: Path, tiny_qwen3_dir: Path) -> None:
    fake_hub.add_repo(REPO, tiny_qwen3_dir, sha=SHA)

    console = recording_console()
    pull([ModelRef(REPO, revision=SHA), ModelRef(str(tiny_qwen3_dir)), str(tiny_qwen3_dir)], console, json=True)
    [entry] = json.loads(console.export_text())  # local directories are skipped
    assert entry["repo_id"] == REPO and entry["revision"] == SHA and entry["commit"] == SHA
    assert entry["download_bytes"] == entry["total_bytes"] > 0
    assert Path(entry["path"], "config.json").is_file()


def test_dropped_connection_resumes_from_the_last_byte(
    fake_hub, hf_home: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub writes (and counts as resumable) whole 10 MB chunks; a tiny file needs tiny chunks
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    served = fake_hub.add_repo(REPO, tiny_qwen3_dir, sha=SHA)
    served.cut_once.add("model.safetensors")
    weights = (tiny_qwen3_dir / "model.safetensors").read_bytes()
    path = resolve_model_dir(REPO, progress=False)
    assert (path / "model.safetensors").read_bytes() == weights
    [resumed] = fake_hub.ranges  # the retry asked only for what was missing
    assert resumed.startswith("bytes=") and 0 < int(resumed[6:].split("-")[0]) <= len(weights) // 2


def test_rerun_after_a_failed_download_fetches_only_missing_files(
    fake_hub, hf_home: Path, tiny_qwen3_dir: Path
) -> None:
    served = fake_hub.add_repo(REPO, tiny_qwen3_dir, sha=SHA)
    served.failing.add("model.safetensors")
    with pytest.raises(DflashError, match=f"huggingface.co failed while fetching model {REPO} \\(HTTP 500\\)"):
        resolve_model_dir(REPO, progress=False)
    served.failing.clear()
    served.requests.clear()
    path = resolve_model_dir(REPO, progress=False)
    downloads = [r for r in served.requests if r.startswith("GET") and "/resolve/" in r]
    assert [r.rsplit("/", 1)[1] for r in downloads] == ["model.safetensors"]
    assert (path / "model.safetensors").read_bytes() == (tiny_qwen3_dir / "model.safetensors").read_bytes()


def test_pickle_only_repo_is_refused_before_downloading(
    fake_hub, hf_home: Path, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copy(tiny_qwen3_dir / "config.json", src)
    (src / "pytorch_model.bin").write_bytes(b"x")
    served = fake_hub.add_repo(REPO, src, sha=SHA)
    with pytest.raises(DflashError, match="safetensors"):
        resolve_model_dir(REPO, progress=False)
    assert not any(r.startswith("GET") and "/resolve/" in r for r in served.requests)


def test_gated_repo_explains_license_and_login_and_hides_the_token(
    fake_hub, hf_home: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.add_repo("meta-llama/Tiny", tiny_qwen3_dir, sha=SHA, gated=True, access_token="hf_granted")
    with pytest.raises(DflashError) as info:
        resolve_model_dir("meta-llama/Tiny", what="target", progress=False)
    err = str(info.value)
    assert "gated" in err and "https://huggingface.co/meta-llama/Tiny" in err
    assert "hf auth login" in err and "not logged in" in err

    monkeypatch.setenv("HF_TOKEN", "hf_SECRETtoken123")
    with pytest.raises(DflashError) as info:
        resolve_model_dir("meta-llama/Tiny", progress=False)
    assert "lacks access" in str(info.value) and "SECRET" not in str(info.value)

    monkeypatch.setenv("HF_TOKEN", "hf_granted")  # license accepted: the same call downloads
    assert (resolve_model_dir("meta-llama/Tiny", progress=False) / "model.safetensors").is_file()


def test_unknown_repo_and_revision(fake_hub, hf_home: Path, tiny_qwen3_dir: Path) -> None:
    fake_hub.add_repo(REPO, tiny_qwen3_dir, sha=SHA)
    with pytest.raises(DflashError, match="not found on huggingface.co"):
        resolve_model_dir("tiny-org/nope", progress=False)
    with pytest.raises(DflashError, match="no revision 'v9'"):
        resolve_model_dir(REPO, revision="v9", progress=False)


def test_disk_space_is_checked_before_downloading(
    fake_hub, hf_home: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = fake_hub.add_repo(REPO, tiny_qwen3_dir, sha=SHA)
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DflashError, match="only 1.0 kB is free") as info:
        resolve_model_dir(REPO, progress=False)
    assert "HF_HOME" in info.value.fix
    assert not any(r.startswith("GET") and "/resolve/" in r for r in served.requests)


def test_check_disk_space_on_a_missing_cache_dir(tmp_path: Path) -> None:
    check_disk_space(1, tmp_path / "not" / "yet")
    with pytest.raises(DflashError):
        check_disk_space(10**18, tmp_path / "not" / "yet")


def _http_error(cls: type[HfHubHTTPError], status: int) -> HfHubHTTPError:
    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/x")
    return cls(f"{status} error", response=httpx2.Response(status, request=request))


def test_hub_error_mapping(hf_home: Path) -> None:
    gated = hub.hub_error(_http_error(GatedRepoError, 401), "org/x", "main", "target")
    assert "gated" in gated.message and "huggingface.co/org/x" in gated.fix
    assert "gated" in hub.hub_error(_http_error(HfHubHTTPError, 403), "org/x", "main").message
    server = hub.hub_error(_http_error(HfHubHTTPError, 503), "org/x", "v1")
    assert "HTTP 503" in server.message and "(revision v1)" in server.message and "kept" in server.fix
    full = hub.hub_error(OSError(28, "No space left on device"), "org/x", "main")
    assert "disk filled up" in full.message


def test_a_drafters_vocabulary_is_fetched_even_into_a_snapshot_cached_without_it(
    fake_hub, hf_home: Path, tmp_path: Path
) -> None:
    drafter = tmp_path / "drafter"
    shutil.copytree(ROOT / "tests" / "fixtures" / "qwen3-tiny" / "drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    config.setdefault("dflash_config", {})["draft_vocab_size"] = 3
    (drafter / "config.json").write_text(json.dumps(config))
    older = tmp_path / "older"  # what a dflash that did not know the file cached
    shutil.copytree(drafter, older)
    (drafter / "draft_vocab.json").write_text("[3, 9, 11]")
    make_hf_cache(hf_home, "org/drafter", older, sha=SHA)
    assert hub.missing_model_files(hub._cached_snapshot("org/drafter", "main")) == ["draft_vocab.json"]
    fake_hub.add_repo("org/drafter", drafter, sha=SHA)
    path = resolve_model_dir("org/drafter", progress=False)
    assert json.loads((path / "draft_vocab.json").read_text()) == [3, 9, 11]
