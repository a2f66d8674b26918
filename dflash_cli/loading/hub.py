"""Model acquisition: a local directory or a Hugging Face repo, cached, downloaded, or explained.

Downloads go through huggingface_hub's `snapshot_download` into the standard cache (HF_HOME / HF_HUB_CACHE), so
models fetched by other tools are reused and interrupted downloads resume: a dropped connection is retried from
the byte it stopped at, files finished before an interruption are kept and skipped by the next run, and Xet-stored
repos reuse the chunks already in the Xet cache. Only safetensors weights, configs, tokenizer files and chat
templates are fetched: pickle weights (`.bin`, `.pt`, `.pth`) can run code when loaded and are never downloaded.
"""

from __future__ import annotations

import contextlib
import difflib
import json as jsonlib
import os
import shutil
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import constants, get_token, snapshot_download
from huggingface_hub.errors import (
    DryRunError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import validate_repo_id
from rich.console import Console
from rich.filesize import decimal as format_bytes
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from tqdm.std import tqdm

from dflash_cli.errors import DflashError
from dflash_cli.protocol.drafters import DRAFT_VOCAB_FILE

if TYPE_CHECKING:
    from dflash_cli.setup.recipes import ModelRef

ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    DRAFT_VOCAB_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "*.model",  # sentencepiece / tiktoken vocabularies
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
# Subfolders hold other formats (Llama's `original/` .pth, GGUF variants), `consolidated*` is Mistral's duplicate
# of the weights in its own format: fetching them would double the download for nothing.
IGNORE_PATTERNS = ["*/*", "consolidated*"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DEFAULT_REVISION = "main"


@dataclass
class PlannedFile:
    name: str
    size: int
    cached: bool


@dataclass
class DownloadPlan:
    """What fetching one repo at one revision means: its files, what is cached, what must be downloaded."""

    repo_id: str
    revision: str
    commit: str | None
    files: list[PlannedFile]
    cache_dir: str
    path: str | None = None  # the snapshot directory, once complete

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files if not f.cached)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes, "download_bytes": self.download_bytes}


def resolve_model_dir(
    ref: str,
    *,
    revision: str | None = None,
    what: str = "model",
    allow_download: bool = True,
    progress: bool = True,
) -> Path:
    """The directory holding `ref`'s weights, configs and tokenizer.

    `ref` is a local directory (returned as is after checking it holds a model) or a Hub repo id `org/name`:
    a complete cached snapshot is used without touching the network (`dflash pull` refreshes a branch), otherwise
    the repo is downloaded (size shown and disk space checked first; progress on stderr) unless `allow_download`
    is False or HF_HUB_OFFLINE=1 is set. `what` names the role ("target", "drafter") in messages.
    """
    local = _local_dir(ref, what)
    if local is not None:
        return local
    repo_id = _validate_repo_id(ref, what)
    rev = revision or DEFAULT_REVISION
    cached = _cached_snapshot(repo_id, rev)
    if cached is not None and not missing_model_files(cached):
        return cached
    if not allow_download or constants.is_offline_mode():
        if cached is not None:
            check_model_dir(cached, what=what, ref=repo_id)  # names what the cached copy lacks
        raise _not_cached_error(repo_id, rev, what, reason="offline")
    plan = plan_download(repo_id, revision=rev, what=what)
    console = Console(stderr=True) if progress else None
    if console is not None:
        console.print(
            f"{what} {repo_id}: {format_bytes(plan.download_bytes)} to download into {plan.cache_dir} "
            "[dim](if interrupted, run again: finished files are kept)[/]"
        )
    path = download(plan, console=console, what=what)
    check_model_dir(path, what=what, ref=repo_id)
    return path


def plan_download(ref: str, revision: str | None = None, *, what: str = "model") -> DownloadPlan:
    """Per-file sizes of `ref` at `revision` and which are already cached, without downloading anything.

    Asks the Hub (a dry run of `snapshot_download`); offline or when the Hub cannot be reached, describes the
    cached snapshot instead, or raises the not-cached error.
    """
    repo_id = _validate_repo_id(ref, what)
    rev = revision or DEFAULT_REVISION
    try:
        infos = snapshot_download(
            repo_id,
            revision=rev,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            dry_run=True,
            tqdm_class=_QuietTqdm,
        )
    except DryRunError as exc:  # the Hub was not reachable or refused: the reason is the cause
        cause = exc.__cause__
        if isinstance(cause, HfHubHTTPError) and not _is_server_side(cause):
            raise hub_error(cause, repo_id, rev, what) from None
        return _plan_from_cache(repo_id, rev, what)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise hub_error(exc, repo_id, rev, what) from None
    files = [PlannedFile(i.filename, i.file_size or 0, i.is_cached) for i in infos]
    _require_safetensors([f.name for f in files], repo_id, what)
    commit = infos[0].commit_hash if infos else None
    return DownloadPlan(repo_id, rev, commit, sorted(files, key=lambda f: f.name), constants.HF_HUB_CACHE)


def check_disk_space(download_bytes: int, cache_dir: str | os.PathLike) -> None:
    """Refuse before a download that cannot fit on the disk holding the HF cache."""
    existing = Path(cache_dir)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if download_bytes > free:
        raise DflashError(
            f"the download needs {format_bytes(download_bytes)} but only {format_bytes(free)} is free on the disk "
            f"holding the Hugging Face cache ({cache_dir})",
            fix="free some space, or point HF_HOME (or HF_HUB_CACHE) at a disk with more room",
        )


def download(plan: DownloadPlan, *, console: Console | None = None, what: str = "model") -> Path:
    """Fetch what `plan` lists as missing into the HF cache; returns the snapshot directory.

    With a console, shows a byte progress bar (rich) on it; without, downloads silently.
    """
    check_disk_space(plan.download_bytes, plan.cache_dir)
    kwargs: dict[str, Any] = dict(
        revision=plan.revision, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS, tqdm_class=_QuietTqdm
    )
    try:
        if console is None or plan.download_bytes == 0:
            path = snapshot_download(plan.repo_id, **kwargs)
        else:
            with _BlobProgress(plan, console):
                path = snapshot_download(plan.repo_id, **kwargs)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise hub_error(exc, plan.repo_id, plan.revision, what) from None
    plan.path = path
    return Path(path)


def pull(
    refs: Sequence[str | ModelRef | None],
    console: Console,
    *,
    dry_run: bool = False,
    json: bool = False,
    print_json: bool = True,
) -> list[DownloadPlan]:
    """`dflash pull`: show the total size of `refs`, check disk space, then download them with a progress bar.

    `refs` are repo ids or ModelRefs (pinned with `.revision`), e.g. `[recipe.target, recipe.drafter]`; None
    and local directories are skipped. With `json`, prints the plans (and snapshot paths) as one JSON document
    (unless `print_json` is False: the caller prints them with more) and no progress.
    """
    remote = [_ref_parts(ref) for ref in refs if ref is not None and not _is_local(ref)]
    plans = [plan_download(ref_id, revision) for ref_id, revision in remote]
    if not json and plans:
        _print_plans(plans, console)
    if not dry_run:
        check_disk_space(sum(p.download_bytes for p in plans), constants.HF_HUB_CACHE)
        for plan in plans:
            download(plan, console=None if json else console)
            if not json:
                console.print(f"[green]✓[/] {plan.repo_id} ready in {plan.path}")
    if json and print_json:
        console.print_json(jsonlib.dumps([p.to_dict() for p in plans]))
    return plans


def display_name(model_dir: Path) -> str:
    """`org/name` for a snapshot in the HF cache (`.../models--org--name/snapshots/<sha>`), else the path."""
    if model_dir.parent.name == "snapshots" and model_dir.parent.parent.name.startswith("models--"):
        return model_dir.parent.parent.name.removeprefix("models--").replace("--", "/")
    return str(model_dir)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of `model_dir`: the shards its `model.safetensors.index.json` lists (present or not),
    else its `*.safetensors` files."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        shards = sorted(set(jsonlib.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError, TypeError):
        raise DflashError(
            f"{index} is not a valid safetensors index (broken JSON or no weight_map)",
            fix="delete it and re-run `dflash pull`, or restore it from the original model",
        ) from None
    return [model_dir / shard for shard in shards]


def missing_model_files(model_dir: Path) -> list[str]:
    """Files a loadable model directory lacks: config.json, safetensors weights, shards its index lists, or the
    draft vocabulary its config names (a snapshot cached by a dflash that did not fetch it)."""
    missing = [] if (model_dir / "config.json").is_file() else ["config.json"]
    if not missing and not (model_dir / DRAFT_VOCAB_FILE).is_file() and _names_draft_vocabulary(model_dir):
        missing.append(DRAFT_VOCAB_FILE)
    weights = safetensors_files(model_dir)
    if not weights:
        missing.append("*.safetensors")
    missing += [w.name for w in weights if not w.is_file()]
    return missing


def _names_draft_vocabulary(model_dir: Path) -> bool:
    try:
        config = jsonlib.loads((model_dir / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False  # (loading says what is wrong with it)
    nested = config.get("dflash_config") if isinstance(config, dict) else None
    return isinstance(nested, dict) and nested.get("draft_vocab_size") is not None


def check_model_dir(model_dir: Path, *, what: str = "model", ref: str | None = None) -> None:
    """Raise a DflashError naming what `model_dir` lacks to be loaded (config, weights, shards)."""
    missing = missing_model_files(model_dir)
    if not missing:
        return
    name = ref or str(model_dir)
    if missing == ["config.json"] or not (model_dir / "config.json").is_file():
        inside = model_dir / "drafter"  # (a `dflash train` output folder: its drafter is one level down)
        raise DflashError(
            f"{what} {name}: {model_dir} has no config.json, so it is not a Hugging Face model directory",
            fix=f"pass {inside}: the drafter of that training run"
            if (inside / "config.json").is_file()
            else "pass the directory that holds config.json and the *.safetensors weights",
        )
    if "*.safetensors" in missing:
        _require_safetensors([p.name for p in model_dir.iterdir()], name, what)
    raise DflashError(
        f"{what} {name} is incomplete: {', '.join(missing)} missing in {model_dir}",
        fix=f"run `{pull_command(ref)}` to fetch the missing files" if ref else None,
    )


def hub_error(exc: BaseException, repo_id: str, revision: str, what: str = "model") -> DflashError:
    """Translate a huggingface_hub failure into one actionable DflashError (never echoing the token)."""
    where = f"{what} {repo_id}" + (f" (revision {revision})" if revision != DEFAULT_REVISION else "")
    login = (
        "your Hugging Face token was sent but lacks access"
        if get_token()
        else "you are not logged in (no HF_TOKEN, no `hf auth login`)"
    )
    if isinstance(exc, GatedRepoError) or (isinstance(exc, HfHubHTTPError) and _status(exc) == 403):
        return DflashError(
            f"{where} is gated: its license must be accepted on huggingface.co before downloading; {login}",
            fix=f"open https://huggingface.co/{repo_id}, accept the license with your account, then run "
            "`hf auth login` (or set HF_TOKEN) and retry",
        )
    if isinstance(exc, RepositoryNotFoundError) or (isinstance(exc, HfHubHTTPError) and _status(exc) == 401):
        return DflashError(
            f"{where} was not found on huggingface.co (or it is private or gated and {login})",
            fix="check the spelling of the repo id; for a private or gated repo run `hf auth login` (or set "
            "HF_TOKEN) with an account that has access",
        )
    if isinstance(exc, RevisionNotFoundError):
        return DflashError(
            f"{what} {repo_id} has no revision {revision!r} (branch, tag or commit) on huggingface.co",
            fix=f"see https://huggingface.co/{repo_id}/commits/main for valid revisions, or drop --revision",
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return _not_cached_error(repo_id, revision, what, reason="offline" if constants.is_offline_mode() else "")
    if isinstance(exc, HfHubHTTPError) and _is_server_side(exc):
        return DflashError(
            f"huggingface.co failed while fetching {where} (HTTP {_status(exc)})",
            fix="retry in a moment; files finished so far are kept",
        )
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno == 28:  # ENOSPC
        return DflashError(
            f"the disk filled up while downloading {where}",
            fix="free some space or point HF_HOME at a bigger disk, then run `dflash pull` again "
            "(finished files are kept)",
        )
    return DflashError(
        f"could not fetch {where}: {type(exc).__name__}: {exc}",
        fix="check your network connection and retry; files finished so far are kept",
    )


def _ref_parts(ref: str | ModelRef) -> tuple[str, str | None]:
    return (ref, None) if isinstance(ref, str) else (ref.id, ref.revision)


def _is_local(ref: str | ModelRef) -> bool:
    if isinstance(ref, str):
        return Path(ref).expanduser().is_dir()
    return ref.path is not None  # a local or packaged (`package:`) directory


def _status(exc: HfHubHTTPError) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _is_server_side(exc: HfHubHTTPError) -> bool:
    status = _status(exc)
    return status is not None and status >= 500


def _looks_like_path(ref: str) -> bool:
    windows_separator = os.sep != "/" and os.sep in ref
    return ref.startswith((".", "/", "~")) or ref.endswith("/") or ref.count("/") > 1 or windows_separator


def _local_dir(ref: str, what: str) -> Path | None:
    path = Path(ref).expanduser()
    if path.is_dir():
        check_model_dir(path, what=what)
        return path.resolve()
    if path.exists():
        raise DflashError(
            f"{what} {ref} is a file; a model is a directory holding config.json and *.safetensors",
            fix=f"pass its directory: {path.parent}",
        )
    if _looks_like_path(ref):
        raise DflashError(f"{what} directory {ref} does not exist", fix="check the path")
    return None


def _validate_repo_id(ref: str, what: str) -> str:
    try:
        validate_repo_id(ref)
    except HFValidationError:
        raise DflashError(
            f"{what} {ref!r} is neither a local directory nor a Hugging Face repo id",
            fix="pass a repo id like Qwen/Qwen3-8B or the path of a directory holding config.json",
        ) from None
    return ref


def _cached_snapshot(repo_id: str, revision: str) -> Path | None:
    """The cached snapshot of `repo_id` at `revision`, or None when it is not cached or is known incomplete."""
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            local_files_only=True,
            tqdm_class=_QuietTqdm,
        )
    except LocalEntryNotFoundError:  # includes IncompleteSnapshotError: the tree listing shows missing files
        return None
    return Path(path)


def _plan_from_cache(repo_id: str, revision: str, what: str) -> DownloadPlan:
    snapshot = _cached_snapshot(repo_id, revision)
    if snapshot is None:
        raise _not_cached_error(repo_id, revision, what, reason="offline" if constants.is_offline_mode() else "")
    files = [
        PlannedFile(p.relative_to(snapshot).as_posix(), p.stat().st_size, True)
        for p in sorted(snapshot.rglob("*"))
        if p.is_file()
    ]
    return DownloadPlan(repo_id, revision, snapshot.name, files, constants.HF_HUB_CACHE, path=str(snapshot))


def _require_safetensors(names: Iterable[str], repo: str, what: str) -> None:
    names = list(names)
    if any(n.endswith(".safetensors") for n in names):
        return
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise DflashError(
            f"{what} {repo} ships its weights only as pickle files ({', '.join(pickles[:3])}); dflash loads "
            "safetensors only, because unpickling a checkpoint can run arbitrary code",
            fix="use a safetensors variant of the model (most Hub repos have one), or convert a checkpoint you "
            "trust: load it with transformers and call save_pretrained(dir), then pass that directory",
        )
    raise DflashError(
        f"{what} {repo} has no *.safetensors weights",
        fix="check that the repo id points at model weights (not a GGUF-only or adapter-only repo)",
    )


def _recipes() -> list[Any]:
    from dflash_cli.setup.recipes import load_recipes

    try:
        return list(load_recipes().values())
    except DflashError:  # a broken user recipe must not hide the error being reported
        return []


def pull_command(repo_id: str, revision: str | None = None, what: str = "target") -> str:
    """The command line that fetches `repo_id`: `dflash pull` with the recipe's name when a recipe uses it as its
    target or drafter (`dflash pull qwen3-8b` fetches both), else with the target alone; a drafter of no recipe
    with the Hub's own `hf download`."""
    pinned = revision and revision != DEFAULT_REVISION
    if not pinned:
        wanted = repo_id.lower()
        for recipe in _recipes():
            if any(ref is not None and ref.id.lower() == wanted for ref in (recipe.target, recipe.drafter)):
                return f"dflash pull {recipe.name}"
    if what == "drafter":
        return f"hf download {repo_id}" + (f" --revision {revision}" if pinned else "")
    return f"dflash pull --target {repo_id}" + (f" --revision {revision}" if pinned else "")


def _not_cached_error(repo_id: str, revision: str, what: str, *, reason: str) -> DflashError:
    elsewhere = (
        f"or run `{pull_command(repo_id, revision, what)}` on a machine with network and copy its Hugging Face "
        f"cache directory to {constants.HF_HUB_CACHE}, or pass a local model directory instead"
    )
    if reason == "offline":
        why, fix = "downloads are off (HF_HUB_OFFLINE=1)", "unset HF_HUB_OFFLINE to download it, " + elsewhere
    else:
        why, fix = "huggingface.co cannot be reached", "check the network (or HTTPS_PROXY) and retry, " + elsewhere
    if "/" not in repo_id:  # no ORG/NAME and no directory here: a recipe's name given as a model, or a typo
        meant = difflib.get_close_matches(repo_id, [recipe.name for recipe in _recipes()], n=1, cutoff=0.6)
        recipe = f"did you mean the recipe {meant[0]}? " if meant else ""
        fix = f"{recipe}the recipes: `dflash recipes list`; a Hub model is usually ORG/NAME; {fix}"
    folder = Path(repo_id).expanduser().parent
    if "/" in repo_id and folder.is_dir():  # (`runs/nonexist`: meant as a path, as likely as a repo id)
        fix = f"as a path: {folder} holds no {Path(repo_id).name} (`ls {folder}`); as a repo id: {fix}"
    return DflashError(
        f"{what} {repo_id} (revision {revision}) is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}",
        fix=fix,
    )


def _print_plans(plans: list[DownloadPlan], console: Console) -> None:
    table = Table(box=None, pad_edge=False)
    for column in ("repo", "revision", "files", "size", "to download"):
        table.add_column(column, justify="right" if column in ("files", "size", "to download") else "left")
    for p in plans:
        sizes = (format_bytes(p.total_bytes), format_bytes(p.download_bytes))
        table.add_row(p.repo_id, p.revision, str(len(p.files)), *sizes)
    console.print(table)
    need = sum(p.download_bytes for p in plans)
    total = sum(p.total_bytes for p in plans)
    if not need:
        console.print(f"total {format_bytes(total)}, everything is cached in {constants.HF_HUB_CACHE}")
        return
    console.print(f"total {format_bytes(total)}, {format_bytes(need)} to download into {constants.HF_HUB_CACHE}")
    console.print("[dim]if interrupted, run the same command again: finished files are kept[/]")


@contextlib.contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """transformers' own tqdm bars off (they tear through rich's spinners and progress bars), restored after."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


class _QuietTqdm(tqdm):
    """huggingface_hub's own bars off: `_BlobProgress` draws the one rich bar instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


class _BlobProgress:
    """A rich byte bar for one repo, fed by the growth of its blob directory (finished and `.incomplete` files).

    Watching the disk rather than hooking huggingface_hub's tqdm bars works the same for HTTP and Xet transfers
    and shows resumed bytes as already done.
    """

    def __init__(self, plan: DownloadPlan, console: Console) -> None:
        self.blobs = Path(plan.cache_dir) / repo_folder_name(repo_id=plan.repo_id, repo_type="model") / "blobs"
        self.total = plan.download_bytes
        self.done = threading.Event()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.progress.add_task(plan.repo_id, total=self.total)
        self.finished_before = self._blob_bytes(incomplete=False)

    def _blob_bytes(self, *, incomplete: bool = True) -> int:
        total = 0
        for entry in os.scandir(self.blobs) if self.blobs.is_dir() else ():
            if incomplete or not entry.name.endswith(".incomplete"):
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:  # an `.incomplete` file renamed to its final name meanwhile
                    pass
        return total

    def _poll(self) -> None:
        while not self.done.wait(0.25):
            done = min(self._blob_bytes() - self.finished_before, self.total)
            self.progress.update(self.task, completed=done)

    def __enter__(self) -> _BlobProgress:
        self.progress.start()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.done.set()
        self.thread.join()
        if exc_type is None:
            self.progress.update(self.task, completed=self.total)
        self.progress.stop()


HUB_TIMEOUT_S = 3.0  # dflash doctor's question: is the Hub there?


def hub_reachable(endpoint: str, timeout: float = HUB_TIMEOUT_S) -> str | None:
    """None when the Hub at `endpoint` answers a HEAD request (any HTTP status: something answered), else why
    not. Honours HTTPS_PROXY / HTTP_PROXY as huggingface_hub does."""
    import socket
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        return f"it answers HTTP {exc.code}" if exc.code >= 500 else None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return f"no answer within {timeout:g} s"
        return str(reason) or type(reason).__name__
