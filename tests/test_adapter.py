"""An existing LoRA adapter on disk: its shape from its config and weights, and one-line errors for what is not one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from lowmem_ft.adapter import locate
from lowmem_ft.errors import UserError
from tests.saved_adapters import edit_config, save_adapter


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return save_adapter(tiny_model, tmp_path_factory.mktemp("adapters") / "qv", r=4, alpha=8)


def _config(model: str) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def test_the_adapter_decides_its_shape(adapter, tiny_model):
    saved = locate(str(adapter))
    assert (saved.r, saved.alpha, saved.dropout) == (4, 8, 0.0)
    assert saved.target_modules == ("q_proj", "v_proj")
    assert saved.base == tiny_model
    assert saved.section() == {"kind": "lora", "r": 4, "alpha": 8, "dropout": 0.0,
                               "target_modules": ["q_proj", "v_proj"], "use_dora": False,
                               "init": "default"}  # fmt: skip
    c = _config(tiny_model)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    shapes = {(m.layer, m.name): (m.r, m.in_features, m.out_features) for m in saved.matrices}
    assert len(shapes) == 2 * c["num_hidden_layers"]  # q and v in every layer, read from the safetensors header
    assert shapes[(0, "q_proj")] == (4, c["hidden_size"], c["num_attention_heads"] * head_dim)
    assert shapes[(1, "v_proj")] == (4, c["hidden_size"], c["num_key_value_heads"] * head_dim)
    assert saved.uncounted == ()


def test_a_run_directory_stands_for_its_adapter(adapter, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "adapter").symlink_to(adapter, target_is_directory=True)
    assert locate(str(run)).path == run / "adapter"


def test_the_weights_name_the_modules_a_pattern_targets(tiny_model, tmp_path):
    saved = locate(str(save_adapter(tiny_model, tmp_path / "regex", targets=r".*\.(k_proj|o_proj)")))
    assert json.loads((tmp_path / "regex" / "adapter_config.json").read_text())["target_modules"].startswith(".*")
    assert saved.target_modules == ("k_proj", "o_proj")


def test_a_dora_adapter_is_priced_as_dora(tiny_model, tmp_path):
    from lowmem_ft.choosing import choose_recipe

    path = save_adapter(tiny_model, tmp_path / "dora", use_dora=True)
    saved = locate(str(path))
    assert saved.uncounted == () and saved.section()["use_dora"] is True
    recipe, choice = choose_recipe(vram_gb=8, recipe=None, overrides={"adapter": {"name_or_path": str(path)}},
                                   seq_len=256)  # fmt: skip
    assert recipe.adapter.use_dora and choice.plan.setup.use_dora
    assert choice.plan.estimate.by_name()["DoRA weight norms (kept)"] > 0


def test_an_adapter_in_its_pissa_form_is_refused_in_one_line(tiny_model, tmp_path):
    path = save_adapter(tiny_model, tmp_path / "pissa")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | {"init_lora_weights": "pissa_niter_4"}))
    with pytest.raises(UserError, match="residual base only; continue that run with --resume"):
        locate(str(path))


def test_a_misfit_is_found_from_the_header_alone(tmp_path):
    import torch

    path = tmp_path / "wide"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"]}))  # fmt: skip
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    save_file({key.format(0, "A"): torch.zeros(4, 999), key.format(0, "B"): torch.zeros(64, 4),
               key.format(5, "A"): torch.zeros(4, 999), key.format(5, "B"): torch.zeros(64, 4)},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    saved = locate(str(path))
    assert (
        saved.misfit({"q_proj": (64, 64)}, num_layers=8) == "q_proj is 999 → 64 in the adapter but 64 → 64 in the model"
    )
    assert saved.misfit({"q_proj": (999, 64)}, num_layers=2) == (
        "it adapts layer 5 (model.layers.5.self_attn.q_proj) but the model has 2 layers"
    )
    assert saved.misfit({"q_proj": (999, 64)}, num_layers=8) is None


def _missing(tmp_path: Path) -> str:
    return str(tmp_path / "no" / "such" / "dir")


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "f.json").write_text("{}")
    return str(tmp_path / "f.json")


def _empty_dir(tmp_path: Path) -> str:
    (tmp_path / "empty").mkdir()
    return str(tmp_path / "empty")


def _hub_id(tmp_path: Path) -> str:
    return "someone/adapter"  # not a local path: a Hub id, and the tests run with HF_HUB_OFFLINE=1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_missing, "no such directory (and not a Hub id"),
        (_a_file, "is a file; pass the directory"),
        (_empty_dir, "has no adapter_config.json"),
        (
            _hub_id,
            "is not a local directory, so it is read as a Hugging Face Hub id, and the Hub is unreachable "
            "(offline mode is on, HF_HUB_OFFLINE=1)",
        ),  # fmt: skip
    ],
)
def test_what_is_not_an_adapter_is_one_line(tmp_path, make, message):
    with pytest.raises(UserError) as info:
        locate(make(tmp_path))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_adapter_of_another_method_is_refused(adapter, tmp_path):
    import shutil

    ia3 = edit_config(Path(shutil.copytree(adapter, tmp_path / "ia3")), peft_type="IA3")
    with pytest.raises(UserError, match="is a IA3 adapter; lowmem-ft continues LoRA adapters"):
        locate(str(ia3))
