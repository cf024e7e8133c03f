"""A run on the Hugging Face Hub (`train --push-to-hub`, `merge --push-to-hub`): pre-flight, model card, upload.

The one idea: an upload that cannot happen must fail before training, not after hours of it. `preflight` checks all
but the upload itself — a valid repo id, the Hub not in offline mode, a token, a token the Hub accepts, with write
access to the namespace — and says what is wrong in one line. The model card (README.md in the uploaded folder, a
`huggingface_hub.ModelCard`) records what the run is, from its run directory alone: base model, data, the resolved
recipe, the plan's predicted peak and budget, the peak measured in memory.jsonl, results and library versions.
The upload is huggingface_hub's own (`HfApi.create_repo`, `upload_folder`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.rundir import RunDir

CARD = "README.md"  # the Hub shows a repository's README.md as its model card


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now; huggingface_hub reads it once, at import."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or env.strip().lower() in ("1", "true", "yes", "on")


def _api():
    """The Hub client (tests replace this with a recording fake)."""
    from huggingface_hub import HfApi

    return HfApi()


@dataclass(frozen=True)
class HubRepo:
    """Where a run goes: the full repo id (namespace/name), the user whose token uploads, and its visibility."""

    repo_id: str
    user: str
    private: bool = False

    @property
    def url(self) -> str:
        from huggingface_hub import constants

        return f"{constants.ENDPOINT}/{self.repo_id}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]


def _whoami(flag: str) -> dict[str, Any]:
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return _api().whoami()
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status == 401:
            raise UserError(f"{flag}: the Hub refuses your token ({_first_line(exc)}); run `hf auth login`") from None
        raise UserError(f"{flag}: the Hub answered {status or 'an error'} ({_first_line(exc)})") from None
    except Exception as exc:  # no network, DNS, proxy, TLS: httpx's errors, or huggingface_hub's ConnectionError
        raise UserError(
            f"{flag}: cannot reach the Hugging Face Hub ({type(exc).__name__}: {_first_line(exc)}); check the "
            "network (or HF_ENDPOINT), or drop the flag and upload later with `hf upload`"
        ) from None


def preflight(repo: str, *, private: bool = False, flag: str = "--push-to-hub") -> HubRepo:
    """Everything an upload to `repo` needs but the upload: a one-line UserError now instead of a failure later."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        raise UserError(f"{flag} {repo!r}: not a Hub repo id, NAME or ORG/NAME ({_first_line(exc)})") from None
    if hub_offline():
        raise UserError(
            f"{flag} {repo}: the Hub is in offline mode (HF_HUB_OFFLINE=1); unset it to upload, or drop the flag and "
            "upload later with `hf upload`"
        )
    if not get_token():
        raise UserError(f"{flag} {repo}: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN")
    who = _whoami(flag)
    user = str(who.get("name") or "")
    role = (who.get("auth") or {}).get("accessToken", {}).get("role")
    if role == "read":
        raise UserError(f"{flag} {repo}: your token ({user}) is read-only; create a write token and `hf auth login`")
    namespace, _, name = repo.rpartition("/")
    orgs = {str(o.get("name")) for o in who.get("orgs") or [] if isinstance(o, dict)}
    if namespace and namespace != user and namespace not in orgs:
        raise UserError(
            f"{flag} {repo}: you are logged in as {user}, who is not a member of {namespace}; use {user}/{name} or "
            "log in as a member"
        )
    return HubRepo(repo if namespace else f"{user}/{name}", user, private)


# -- the model card ----------------------------------------------------------------------------------------------
def _gb(value: Any) -> str:
    return f"{value:.2f} GB" if isinstance(value, (int, float)) else "—"


def _memory_lines(run: RunDir, info: dict[str, Any]) -> list[str]:
    """Predicted peak, budget and the measured peak, as a table."""
    from lowmem_ft.report import EXACT_LABEL, summarize

    choice = info.get("choice") or {}
    measured: dict[str, Any] = {}
    if run.memory_file().is_file():
        log = run.memory_log()
        measured = summarize(log.start, log.samples, log.events)
    rows = [
        ("VRAM target", _gb(choice.get("vram_gb"))),
        ("safety margin", _gb(choice.get("safety_margin_gb"))),
        ("budget (VRAM − margin)", _gb(choice.get("budget_gb"))),
        ("predicted peak (plan)", _gb(choice.get("predicted_peak_gb"))),
    ]
    if "measured_peak_gb" in measured:
        where = f"{measured['measure']}, {measured['peak_phase']} of step {measured['peak_step']}"
        rows.append(("measured peak", f"{_gb(measured['measured_peak_gb'])} ({where})"))
        exact = measured.get("exact") or {}
        if exact.get("predicted_gb"):  # a CPU run: its exact live bytes against the memory model's CPU form
            rows.append(("memory model on this run (CPU)", f"measured {_gb(exact['measured_gb'])}, predicted "
                         f"{_gb(exact['predicted_gb'])} ({exact['error'] * 100:+.1f} %)"))  # fmt: skip
        if measured["measure"] in (EXACT_LABEL, "host RSS"):
            rows.append(("note", "trained without CUDA: the measured peak is host memory, not GPU memory"))
    else:
        rows.append(("measured peak", "— (no memory.jsonl)"))
    return ["| memory | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in rows]]


def _data_lines(info: dict[str, Any]) -> list[str]:
    data = info.get("data") or {}
    sources = data.get("sources") or [{"path": data.get("path", "?")}]
    lines = []
    for s in sources:
        fmt = s.get("format") or data.get("format") or "?"
        extra = f", split {s['split']}" if s.get("split") and s.get("split") != "train" else ""
        lines.append(f"- `{s.get('path', '?')}` ({fmt}{extra})")
    lines.append(
        f"- {data.get('train_records', data.get('records', '?'))} training samples"
        + (f", {data['eval_records']} for evaluation" if data.get("eval_records") else "")
        + (f"; loss on {data['loss_on']}" if data.get("loss_on") else "")
    )
    return lines


def _eval_lines(path: Path) -> list[str]:
    """`lowmem-ft eval`'s scores (eval.json in the run directory), as a table with the base and the delta."""
    import json

    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    base = record.get("base") or {}
    limit = f", at most {record['limit']} examples per task" if record.get("limit") else ""
    lines = ["", f"Evaluated with lm-eval (`lowmem-ft eval`{limit}):", ""]
    lines += ["| task | metric | fine-tuned | base | delta |", "|---|---|---|---|---|"] if base else [
        "| task | metric | fine-tuned |", "|---|---|---|"]  # fmt: skip
    for task, row in record.get("finetuned", {}).items():
        for metric, value in row.items():
            if metric.endswith("_stderr"):
                continue
            if base and metric in base.get(task, {}):
                was = base[task][metric]
                lines.append(f"| {task} | {metric} | {value:.4f} | {was:.4f} | {value - was:+.4f} |")
            else:
                lines.append(f"| {task} | {metric} | {value:.4f} |" + (" | |" if base else ""))
    return lines


def _results_lines(metrics: dict[str, Any] | None) -> list[str]:
    if not metrics:
        return ["- no metrics.json (the run did not finish)"]

    def loss(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, (int, float)) else "—"

    lines = [f"- {metrics.get('global_step', '?')} optimizer steps, train loss {loss(metrics.get('first_loss'))} → "
             f"{loss(metrics.get('last_loss'))}"]  # fmt: skip
    if metrics.get("best_eval_loss") is not None:
        lines.append(f"- best eval loss {metrics['best_eval_loss']:.4f} at step {metrics.get('best_step')}")
    return lines


def _usage(repo_id: str, base: str, merged: bool) -> list[str]:
    if merged:
        code = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f"model = AutoModelForCausalLM.from_pretrained({repo_id!r})",
                f"tokenizer = AutoTokenizer.from_pretrained({repo_id!r})"]  # fmt: skip
    else:
        code = ["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
                f"model = AutoPeftModelForCausalLM.from_pretrained({repo_id!r})  # loads the base {base} too",
                f"tokenizer = AutoTokenizer.from_pretrained({repo_id!r})"]  # fmt: skip
        from lowmem_ft import native

        conversion = native.checkpoint_conversion(base)
        if conversion is not None:  # the base's own code does not load: the adapter is for its native form
            return [f"The base {base} is a {conversion.family} checkpoint, which transformers loads only through "
                    f"its own code; this adapter was trained on it as the native {conversion.native_model_type} "
                    f"model (lowmem-ft loads it so). Merge it into a native checkpoint with `lowmem-ft merge`, or "
                    f"load the base through lowmem-ft."]  # fmt: skip
    return ["```python", *code, "```"]


def model_card(run: RunDir, *, repo_id: str = "", merged: bool = False, folder: Path | None = None):
    """The run's model card (`huggingface_hub.ModelCard`): metadata for the Hub, then what the run was and did.
    Its usage example loads `repo_id`, else the local `folder` the card goes into."""
    from huggingface_hub import ModelCard, ModelCardData

    from lowmem_ft.recipe.load import dump

    recipe = run.read_recipe()
    info = run.read_info()
    full = recipe.adapter.kind == "full"
    base = recipe.model.name_or_path
    kind = "merged model" if merged else "full fine-tune" if full else "LoRA adapter"
    storage = "16-bit" if recipe.model.quantization == "none" else recipe.model.quantization.upper()
    tags = ["lowmem-ft", "trl", "sft"]
    if not (full or merged):
        tags += ["lora"] if storage == "16-bit" else ["lora", "qlora"]
    data = ModelCardData(
        base_model=base if not Path(base).exists() else None,  # a local path is no Hub model to link
        library_name="transformers" if merged or full else "peft",
        pipeline_tag="text-generation",
        tags=tags,
    )
    name = repo_id or run.name
    from lowmem_ft import __version__

    versions = {"lowmem-ft": __version__, **(info.get("versions") or {})}
    plan = run.read_plan() or {}
    reasons = plan.get("reasons") or (info.get("choice") or {}).get("reasons") or {}
    body = [
        f"# {name}",
        "",
        f"A {kind} of `{base}`, fine-tuned with lowmem-ft in run `{run.name}` "
        f"({storage} base weights, {recipe.adapter.kind} training"
        + (f", continued from the adapter `{recipe.adapter.name_or_path}`" if recipe.adapter.name_or_path else "")
        + ").",
        "",
        "## Use",
        "",
        *_usage(repo_id or str(folder or run.weights(full)), base, merged or full),
        "",
        "## Data",
        "",
        *_data_lines(info),
        "",
        "## Memory",
        "",
        *_memory_lines(run, info),
        "",
        "## Results",
        "",
        *_results_lines(run.read_metrics()),
        *_eval_lines(run.path / "eval.json"),
        "",
        "## Plan",
        "",
        *([f"- {knob}: {why}" for knob, why in reasons.items()] or ["- the recipe as given (no --vram plan)"]),
        "",
        "## Recipe",
        "",
        "The fully resolved recipe (`lowmem-ft train --recipe recipe.yaml` reproduces the run):",
        "",
        "```yaml",
        dump(recipe).rstrip(),
        "```",
        "",
        "## Framework versions",
        "",
        *[f"- {pkg}: {ver}" for pkg, ver in versions.items()],
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")


def write_card(run: RunDir, folder: Path, *, repo_id: str = "", merged: bool = False) -> Path:
    """The run's model card as `folder`/README.md (replacing peft's placeholder card)."""
    path = Path(folder) / CARD
    model_card(run, repo_id=repo_id, merged=merged, folder=Path(folder)).save(path)
    return path


# -- the upload --------------------------------------------------------------------------------------------------
def push(folder: Path, repo: HubRepo, *, what: str) -> str:
    """Upload `folder` (its README.md is the card) to `repo`; returns the repository's URL."""
    api = _api()
    try:
        api.create_repo(repo.repo_id, private=repo.private, exist_ok=True)
        api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder), commit_message=f"lowmem-ft: {what}")
    except Exception as exc:  # network, permissions, quota: the files are safe on disk, say how to retry
        raise UserError(
            f"upload to {repo.repo_id} failed ({type(exc).__name__}: {_first_line(exc)}); the files are in {folder}: "
            f"retry with `hf upload {repo.repo_id} {folder}`"
        ) from None
    return repo.url


def push_run(run: RunDir, repo: HubRepo) -> str:
    """Upload a finished run's adapter/ (or model/) with its model card."""
    full = run.read_recipe().adapter.kind == "full"
    folder = run.weights(full)
    if not folder.is_dir():
        raise UserError(f"{run.path} has no {folder.name}/ to upload (the run did not finish)")
    write_card(run, folder, repo_id=repo.repo_id)
    return push(folder, repo, what=f"run {run.name}")
