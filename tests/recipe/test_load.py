import pytest

from lowmem_ft.errors import ConfigError, UserError
from lowmem_ft.recipe.load import dump, resolve, shipped_recipes
from lowmem_ft.recipe.schema import Recipe


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_every_shipped_recipe_loads_validates_and_documents_its_command(name):
    recipe = resolve(name)
    assert isinstance(recipe, Recipe)
    first_lines = shipped_recipes()[name].read_text().splitlines()[:3]
    assert any("lowmem-ft train" in line for line in first_lines if line.startswith("#"))


def test_tiers_inherit_base_and_override_it():
    base, small = resolve("base"), resolve("8gb")
    assert small.adapter.r == 8 and base.adapter.r == 16
    assert small.model.quantization == base.model.quantization == "nf4"  # inherited
    assert small.adapter.target_modules == base.adapter.target_modules


def test_precedence_defaults_then_yaml_then_set(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: 24gb\nmemory:\n  micro_batch_size: 3\n")
    recipe = resolve(path, ["memory.micro_batch_size=5", "optimizer.lr=1e-5"])
    assert recipe.memory.micro_batch_size == 5  # --set beats the YAML
    assert recipe.memory.max_seq_len == 2048  # from 24gb
    assert recipe.optimizer.lr == 1e-5
    assert recipe.training.seed == 42  # schema default via base
    assert resolve(path).memory.micro_batch_size == 3  # YAML beats 24gb


def test_misspelled_key_names_the_nearest_key():
    with pytest.raises(ConfigError, match=r"did you mean 'memory.micro_batch_size'"):
        resolve("8gb", ["memory.micro_batchsize=2"])


def test_key_in_the_wrong_section_says_where_it_belongs():
    with pytest.raises(ConfigError, match=r"'lr' belongs under 'optimizer.lr'"):
        resolve(None, {"memory": {"lr": 0.1}})


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as info:
        resolve(
            None, {"memroy": {}, "adapter": {"r": "big"}, "optimizer": {"name": "sgd"}, "training": {"max_steps": 0}}
        )
    problems = info.value.problems
    assert len(problems) == 4
    assert any("did you mean 'memory'" in p for p in problems)
    assert any("'adapter.r' must be an integer" in p for p in problems)
    assert any("'optimizer.name' must be one of" in p for p in problems)
    assert any("training.max_steps" in p for p in problems)


def test_full_finetune_of_quantized_weights_is_rejected():
    with pytest.raises(ConfigError, match="full cannot train nf4"):
        resolve("8gb", ["adapter.kind=full"])


def test_malformed_set_is_an_error():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        resolve("8gb", ["max_steps=5"])


def test_unknown_recipe_suggests_a_shipped_one():
    with pytest.raises(UserError, match="did you mean '24gb'"):
        resolve("24g")


def test_base_loop_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(UserError, match="loops back"):
        resolve(tmp_path / "a.yaml")


def test_dump_round_trips(tmp_path):
    recipe = resolve("24gb", ["training.max_steps=7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump(recipe))
    assert resolve(path) == recipe


def test_set_typos_name_set_and_file_typos_name_the_file(tmp_path):
    """A typo in --set used to be reported against the shipped recipe file."""
    with pytest.raises(ConfigError) as info:
        resolve("8gb", ["memory.max_seq_length=64"])
    assert str(info.value).startswith("--set: unknown key 'memory.max_seq_length'")
    path = tmp_path / "mine.yaml"
    path.write_text("base: 8gb\nmemory:\n  micro_batchsize: 2\n")
    with pytest.raises(ConfigError) as info:
        resolve(path, ["optimizer.lrr=1"])
    message = str(info.value)
    assert f"{path.resolve()}: unknown key 'memory.micro_batchsize'" in message
    assert "--set: unknown key 'optimizer.lrr'" in message
    with pytest.raises(ConfigError, match="^--seq-len: 'memory.max_seq_len' must be at least 16, got 8"):
        resolve("8gb", {"memory": {"max_seq_len": 8}}, origins={"memory.max_seq_len": "--seq-len"})


def test_ranges_are_declared_in_the_schema_and_checked_once():
    from dataclasses import fields

    from lowmem_ft.recipe.schema import MemorySection

    declared = {f.name: (f.metadata.get("ge"), f.metadata.get("lt")) for f in fields(MemorySection)}
    assert declared["micro_batch_size"] == (1, None) and declared["max_seq_len"] == (16, None)
    with pytest.raises(ConfigError, match=r"'memory.micro_batch_size' must be at least 1, got 0"):
        resolve("8gb", ["memory.micro_batch_size=0"])
    with pytest.raises(ConfigError, match=r"'data.eval_fraction' must be in \[0, 1\), got 1.0"):
        resolve("8gb", ["data.eval_fraction=1"])


def test_a_recipe_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeffbase: 8gb\ntraining:\n  max_steps: 7\n".encode())
    assert resolve(path).training.max_steps == 7


def test_an_unreadable_recipe_is_one_line(tmp_path, monkeypatch):
    """Simulated PermissionError: the tests run as root, for whom chmod 000 still reads."""
    from pathlib import Path

    path = tmp_path / "secret.yaml"
    path.write_text("base: 8gb\n")
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == "secret.yaml":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(UserError, match=r"secret.yaml: cannot read the recipe \(Permission denied\)"):
        resolve(path)


def test_tier_recipes_carry_per_method_defaults_and_a_users_value_wins(tmp_path, caplog):
    """A run's method picks its defaults from the tier (DPO's lower learning rate, SimPO's β and γ, a full fine-tune's
    lower rate still); a value given on the command line or in the user's own file wins, and the run says which
    default it replaced."""
    import logging

    sft, dpo = resolve("24gb"), resolve("24gb", ["training.method=dpo"])
    assert sft.optimizer.lr == 2e-4 and dpo.optimizer.lr == 5e-6 and dpo.preference.beta == 0.1
    full = resolve("40gb", ["training.method=dpo", "adapter.kind=full"])
    assert full.optimizer.lr == 1e-6  # methods.dpo/full over methods.dpo
    simpo = resolve("8gb", ["training.method=simpo"])
    assert (simpo.preference.beta, simpo.preference.simpo_gamma) == (2.0, 1.0)
    with caplog.at_level(logging.INFO, logger="lowmem_ft.recipe.load"):
        given = resolve("24gb", ["training.method=dpo", "optimizer.lr=1e-5"], {"optimizer.lr": "--lr"})
    assert given.optimizer.lr == 1e-5
    assert "optimizer.lr=1e-05 from --lr replaces the base.yaml methods.dpo default 5e-06" in caplog.text
    mine = tmp_path / "mine.yaml"  # the user's file sets the rate: it wins over the tier's method default
    mine.write_text("base: 24gb\ntraining:\n  method: orpo\noptimizer:\n  lr: 3.0e-5\n")
    assert resolve(mine).optimizer.lr == 3e-5 and resolve(mine).preference.beta == 0.1
    own = tmp_path / "own.yaml"  # and its own methods block wins over its own keys for that method
    own.write_text("base: 24gb\noptimizer:\n  lr: 1.0e-4\nmethods:\n  kto:\n    optimizer: {lr: 2.0e-6}\n")
    assert resolve(own).optimizer.lr == 1e-4 and resolve(own, ["training.method=kto"]).optimizer.lr == 2e-6


def test_a_wrong_methods_block_is_one_line(tmp_path):
    for block, message in [
        ("methods:\n  dpx: {optimizer: {lr: 1.0e-6}}\n", "methods.dpx: expected a training.method"),
        ("methods:\n  dpo: {training: {method: kto}}\n", "cannot set training.method"),
        ("methods:\n  dpo/qlora: {optimizer: {lr: 1.0e-6}}\n", "optionally with an adapter kind"),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text("base: 24gb\n" + block)
        with pytest.raises(UserError, match=message):
            resolve(path, ["training.method=dpo"])
    path.write_text("base: 24gb\nmethods:\n  dpo: {optimizer: {lrr: 1.0e-6}}\n")
    with pytest.raises(ConfigError, match="did you mean 'optimizer.lr'"):
        resolve(path, ["training.method=dpo"])
