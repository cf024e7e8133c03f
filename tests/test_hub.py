"""Runs on the Hub: the pre-flight check (for real: offline mode, no token, no network), the model card, and the
upload through a recording stand-in for `HfApi` (there is no network here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft import hub
from lowmem_ft.cli import main
from lowmem_ft.errors import UserError
from lowmem_ft.report import summarize
from lowmem_ft.rundir import RunDir

CHAT = str(Path(__file__).parents[1] / "examples" / "chat.jsonl")


class RecordingHfApi:
    """Stands in for `huggingface_hub.HfApi`: answers `whoami` as the given user and records what `create_repo` and
    `upload_folder` were asked to do, with every uploaded file's bytes. Nothing leaves the machine."""

    def __init__(self, user: str = "me", orgs: tuple[str, ...] = ("team",), role: str = "write"):
        self.user, self.orgs, self.role = user, orgs, role
        self.created: list[dict] = []
        self.uploads: list[dict] = []

    def whoami(self):
        return {
            "name": self.user,
            "orgs": [{"name": o} for o in self.orgs],
            "auth": {"accessToken": {"role": self.role}},
        }

    def create_repo(self, repo_id, *, private=None, exist_ok=False):
        self.created.append({"repo_id": repo_id, "private": private, "exist_ok": exist_ok})

    def upload_folder(self, *, repo_id, folder_path, commit_message=None):
        root = Path(folder_path)
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        self.uploads.append({"repo_id": repo_id, "files": files, "message": commit_message})


@pytest.fixture
def online(monkeypatch):
    """The Hub reachable and a token present, as far as lowmem-ft can tell; the client is a `RecordingHfApi`."""
    from huggingface_hub import constants

    api = RecordingHfApi()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(hub, "_api", lambda: api)
    return api


def _one_line(capsys, code) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# -- the pre-flight check, for real --------------------------------------------------------------------------------
def test_offline_mode_stops_train_before_any_data_or_model_work(capsys, tmp_path, monkeypatch):
    # HF_HUB_OFFLINE=1, and a model and data that do not exist: the Hub is the first complaint
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["train", "--vram", "8", "--model", "no/such-model", "--data", str(tmp_path / "nope.jsonl"),
                 "--output-dir", str(tmp_path), "--push-to-hub", "me/run"])  # fmt: skip
    err = _one_line(capsys, code)
    assert "--push-to-hub me/run: the Hub is in offline mode (HF_HUB_OFFLINE=1)" in err
    assert not any(tmp_path.iterdir())  # no run directory was made


def test_no_token_is_one_line(capsys, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    err = _one_line(capsys, main(["train", "--vram", "8", "--model", "x", "--data", "y", "--push-to-hub", "run"]))
    assert "--push-to-hub run: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN" in err


def test_no_network_is_one_line(capsys, monkeypatch):
    """A token, no offline mode, and no network (this machine has none): the real whoami call fails."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    with pytest.raises(UserError, match=r"--push-to-hub: cannot reach the Hugging Face Hub \(\w+"):
        hub.preflight("me/run")


def test_a_repo_id_that_is_none_is_one_line():
    with pytest.raises(UserError, match=r"--push-to-hub 'a/b/c': not a Hub repo id"):
        hub.preflight("a/b/c")


# -- the pre-flight check, against a recorded Hub ------------------------------------------------------------------
def test_a_bare_name_goes_to_the_users_namespace(online):
    assert hub.preflight("run", private=True) == hub.HubRepo("me/run", "me", True)
    assert hub.preflight("team/run").repo_id == "team/run"


def test_a_namespace_the_user_cannot_write_to_is_refused(online):
    with pytest.raises(UserError, match="you are logged in as me, who is not a member of other; use me/run"):
        hub.preflight("other/run")
    online.role = "read"
    with pytest.raises(UserError, match=r"your token \(me\) is read-only"):
        hub.preflight("me/run")


# -- train --push-to-hub and merge --push-to-hub -------------------------------------------------------------------
@pytest.fixture(scope="module")
def pushed(tiny_model, tmp_path_factory):
    """A QLoRA-free 2-step run of the tiny model pushed to team/tiny-lora through the command line."""
    from huggingface_hub import constants

    mp = pytest.MonkeyPatch()
    api = RecordingHfApi()
    mp.delenv("HF_HUB_OFFLINE", raising=False)
    mp.setattr(constants, "HF_HUB_OFFLINE", False)
    mp.setenv("HF_TOKEN", "hf_not_a_real_token")
    mp.setattr(hub, "_api", lambda: api)
    out = tmp_path_factory.mktemp("runs")
    try:
        code = main(["train", "--vram", "8", "--model", tiny_model, "--data", CHAT, "--output-dir", str(out),
                     "--name", "pushed", "--no-wandb", "--max-steps", "2", "--push-to-hub", "team/tiny-lora",
                     "--hub-private"])  # fmt: skip
        assert code == 0
        yield RunDir(out / "pushed"), api, mp
    finally:
        mp.undo()


def test_train_uploads_the_adapter_with_its_card(pushed):
    run, api, _ = pushed
    assert api.created == [{"repo_id": "team/tiny-lora", "private": True, "exist_ok": True}]
    (upload,) = api.uploads
    assert upload["repo_id"] == "team/tiny-lora"
    files = upload["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= set(files)
    assert files["adapter_model.safetensors"] == (run.weights(False) / "adapter_model.safetensors").read_bytes()


def test_the_card_records_recipe_plan_and_measured_peak(pushed):
    run, api, _ = pushed
    card = api.uploads[0]["files"]["README.md"].decode()
    recipe = run.read_recipe()
    plan = run.read_plan()
    log = run.memory_log()
    measured = summarize(log.start, log.samples, log.events)
    assert card.startswith("---\n") and "library_name: peft" in card and "- lowmem-ft" in card
    assert "# team/tiny-lora" in card and "AutoPeftModelForCausalLM.from_pretrained('team/tiny-lora')" in card
    assert f"| predicted peak (plan) | {plan['predicted_peak_gb']:.2f} GB |" in card
    assert f"| budget (VRAM − margin) | {plan['budget_gb']:.2f} GB |" in card
    assert f"| measured peak | {measured['measured_peak_gb']:.2f} GB (exact live tensor bytes, " in card
    exact = measured["exact"]
    assert f"| memory model on this run (CPU) | measured {exact['measured_gb']:.2f} GB, predicted " in card
    assert "trained without CUDA" in card
    assert f"  max_seq_len: {recipe.memory.max_seq_len}\n" in card and "  quantization: " in card
    assert "- max_seq_len: " in card  # the plan's reason lines
    assert f"- `{CHAT}` (messages)" in card and "training samples; loss on assistant turns" in card
    assert "- transformers: " in card and "- lowmem-ft: " in card


def test_the_card_names_a_hub_base_in_its_metadata(pushed, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import ModelCard, constants

    run, _, _ = pushed
    # The card reads the base's config.json (a base that needs converting says so in it): offline, as the Hub is
    # not reachable from the tests. Left online by the fixture (for its push), the lookup retried for 23 s first.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    copy = RunDir(shutil.copytree(run.path, tmp_path / "copy"))
    text = copy.recipe_file.read_text().replace(f"name_or_path: {run.read_recipe().model.name_or_path}",
                                                "name_or_path: Qwen/Qwen2.5-0.5B", 1)  # fmt: skip
    copy.recipe_file.write_text(text)
    card = hub.model_card(copy, repo_id="me/x")
    assert ModelCard(str(card)).data.base_model == "Qwen/Qwen2.5-0.5B"


def test_merge_uploads_the_merged_model_with_its_card(pushed, tmp_path, capsys):
    run, api, _ = pushed
    code = main(["merge", str(run.path), "--output", str(tmp_path / "merged"), "--push-to-hub", "tiny-merged"])
    assert code == 0 and "pushed to https://huggingface.co/me/tiny-merged" in capsys.readouterr().out
    upload = api.uploads[-1]
    assert upload["repo_id"] == "me/tiny-merged"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(upload["files"])
    card = upload["files"]["README.md"].decode()
    assert "library_name: transformers" in card and "A merged model of " in card
    assert "AutoModelForCausalLM.from_pretrained('me/tiny-merged')" in card


def test_merge_checks_the_hub_before_reading_any_weight(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _one_line(capsys, main(["merge", str(tmp_path / "no-run"), "--output", str(tmp_path / "o"),
                                  "--push-to-hub", "me/m"]))  # fmt: skip
    assert "offline mode" in err  # not "run directory ... does not exist": the Hub was checked first


def test_a_failed_upload_says_how_to_retry(pushed, tmp_path):
    run, api, mp = pushed

    def refuse(**kwargs):
        raise PermissionError("403 Forbidden: no write access")

    mp.setattr(api, "upload_folder", refuse)
    with pytest.raises(UserError, match=r"upload to me/again failed \(PermissionError: 403 Forbidden.*retry with "
                                        r"`hf upload me/again .*adapter`"):  # fmt: skip
        hub.push_run(run, hub.HubRepo("me/again", "me"))
    json.loads(run.info_file.read_text())  # the run directory is intact
