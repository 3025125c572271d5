"""``justllm convert`` of a PEFT LoRA adapter (``adapter_config.json`` and
``adapter_model.safetensors``) to llama.cpp's adapter GGUF, which ``--lora NAME=FILE`` loads.

The work is llama.cpp's own ``convert_lora_to_gguf.py`` from the same sdist as the model
converter (``converter.py``), run in the same child process (``converter_process``). It needs
the base model's config and tokenizer, never its weights: ``--base`` (a local model folder or a
hub repo), else the adapter's ``base_model_name_or_path``. A hub base is fetched here, config
and tokenizer only, through justllm's hub code (its endpoint, token and cache); the script is
always handed a folder, so it never reaches the hub itself.

An adapter is not a model: the output is not registered. It goes to the current folder as
``NAME-lora-TYPE.gguf`` unless ``--output`` says otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from justllm.errors import ModelLoadError
from justllm.models.convert import (
    ConvertJob,
    check_not_a_source_file,
    check_space,
    convert_log,
    get_converter,
    output_path,
)
from justllm.models.converter import check_extra
from justllm.models.hf_model import HFModel, read_config, side_files
from justllm.models.quantize import (
    check_output_option,
    check_replaceable,
    check_writable,
    nearest_dir,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
LORA_OUTTYPES = ("f16", "bf16", "f32", "q8_0")


def is_adapter_folder(path: Path) -> bool:
    """A PEFT adapter's folder: its config, and no model config beside it."""
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def is_adapter(source: str, revision: str) -> bool:
    """Whether ``source`` (a local folder or a hub repo) is a PEFT adapter."""
    from justllm.models import hub

    local = Path(source).expanduser()
    if local.exists():
        return local.is_dir() and is_adapter_folder(local)
    if not hub.looks_like_repo(source) or ":" in source:
        return False
    return hub.has_file(source, ADAPTER_CONFIG, revision) and not hub.has_file(
        source, "config.json", revision)


@dataclass
class LoraConvertJob(ConvertJob):
    """A checked adapter conversion: ``source_dir`` holds the adapter, ``base_dir`` the base
    model's config and tokenizer."""

    base_dir: Path = Path()
    alpha: float = 0.0
    rank: int = 0
    makes_adapter = True

    @property
    def output_type(self) -> str:
        return self.outtype.upper()

    def _script_args(self, out: Path) -> list[str]:
        return [str(self.converter.lora_script), "--outfile", str(out), "--outtype",
                self.outtype, "--base", str(self.base_dir), str(self.source_dir)]


def prepare_lora(source: str, *, base: str | None = None, outtype: str = "f16",
                 output: str | None = None, revision: str = "main", force: bool = False,
                 console: Console | None = None) -> LoraConvertJob:
    """Check everything and fetch what converting the adapter ``source`` needs (ValueError or
    ModelLoadError, one line each)."""
    from justllm.models import hub

    console = console or Console(stderr=True, emoji=False)
    check_output_option(output)
    kind = outtype.strip().lower()
    if kind == "auto":
        kind = "f16"
    if kind not in LORA_OUTTYPES:
        raise ValueError(f"--outtype for a LoRA adapter must be one of "
                         f"{', '.join(LORA_OUTTYPES)}, not '{outtype}'")
    check_extra()
    local = Path(source).expanduser()
    repo = commit = None
    if local.exists():
        if revision != "main":
            raise ValueError(f"--revision is a Hugging Face repo's: {source} is a local "
                             "directory")
        adapter_dir, name = local.resolve(), local.resolve().name
    else:
        listing = hub.list_repo(source, revision, probe=ADAPTER_CONFIG)
        weights = [w for w in ADAPTER_WEIGHTS if w in listing.files][:1]
        if not weights:
            raise ModelLoadError(f"{source} @ {listing.commit[:12]} has {ADAPTER_CONFIG} but "
                                 f"no {' or '.join(ADAPTER_WEIGHTS)}")
        console.print(f"downloading the adapter {source} @ {listing.commit[:12]}",
                      highlight=False, soft_wrap=True)
        adapter_dir = hub.download_files(listing, [ADAPTER_CONFIG, *weights])
        repo, commit, name = listing.repo, listing.commit, source.rpartition("/")[2]
    config = _adapter_config(adapter_dir)
    if not any((adapter_dir / w).is_file() for w in ADAPTER_WEIGHTS):
        raise ModelLoadError(f"{adapter_dir} has {ADAPTER_CONFIG} but no "
                             f"{' or '.join(ADAPTER_WEIGHTS)}")
    base_dir, model = _base(base, config, adapter_dir, console)
    model.check_files(weights=False)
    dst = _output(output, name, kind)
    check_not_a_source_file(dst, adapter_dir)
    check_replaceable(dst)
    if dst.exists() and not force:
        raise ValueError(f"{dst} already exists (--force overwrites it)")
    check_writable(nearest_dir(dst.parent))
    size = sum((adapter_dir / w).stat().st_size for w in ADAPTER_WEIGHTS
               if (adapter_dir / w).is_file())
    estimate = int(size * (2 if kind == "f32" else 1.2)) + 1_000_000
    check_space([(dst.parent, estimate, "the adapter GGUF")])
    converter = get_converter(console)
    model.check_architecture(converter.architectures())
    return LoraConvertJob(converter, model, adapter_dir, repo, commit, kind, None, dst,
                          label="", estimate_bytes=estimate,
                          log_path=convert_log(dst), force=force, base_dir=base_dir,
                          alpha=float(config.get("lora_alpha") or 0),
                          rank=int(config.get("r") or 0))


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    peft = str(config.get("peft_type") or "LORA").upper()
    if peft != "LORA":
        raise ModelLoadError(f"{adapter_dir} is a PEFT {peft} adapter; llama.cpp takes LoRA "
                             "adapters only")
    if "lora_alpha" not in config:
        raise ModelLoadError(f"{path} has no lora_alpha")
    for key in ("lora_alpha", "r"):  # (a list was a TypeError traceback at the job's making)
        value = config.get(key)
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, (int, float))):
            raise ModelLoadError(f"{path}: {key} must be a number (got {value!r})")
    return config


def _base(base: str | None, config: dict[str, Any], adapter_dir: Path,
          console: Console) -> tuple[Path, HFModel]:
    """The base model's folder (config and tokenizer) and what it says: ``--base``, else the
    adapter's ``base_model_name_or_path``; a hub repo's small files are downloaded."""
    from justllm.models import hub

    named = base or config.get("base_model_name_or_path")
    if not named or not isinstance(named, str):
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG} names no base model "
                         "(base_model_name_or_path): give --base (a model folder or a hub "
                         "repo; only its config and tokenizer are read)")
    local = Path(named).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelLoadError(f"the base model {local} has no config.json")
        model = HFModel(str(local), read_config(local / "config.json", str(local)),
                        {p.name: p.stat().st_size for p in local.iterdir() if p.is_file()})
        return local.resolve(), model
    if not hub.looks_like_repo(named):
        raise ValueError(f"the base model '{named}' is neither a folder here nor a hub repo "
                         "(give --base)")
    try:
        listing = hub.list_repo(named, "main")
        where = f"{named} @ {listing.commit[:12]}"
        console.print(f"downloading the base model's config and tokenizer from {where}",
                      highlight=False, soft_wrap=True)
        folder = hub.download_files(listing, side_files(list(listing.files)))
    except ModelLoadError as e:
        raise ModelLoadError(f"the adapter's base model: {e} (--base takes a local model "
                             "folder instead)") from None
    return folder, HFModel(where, read_config(folder / "config.json", where), listing.files)


def _output(output: str | None, name: str, kind: str) -> Path:
    """``--output`` (a folder, or a path ending in /, gets the default name), else
    ``NAME-lora-TYPE.gguf`` in the current folder."""
    from justllm.models.refs import name_for_file

    file = f"{name_for_file(name)}-lora-{kind}.gguf"
    return output_path(output, file) if output else Path.cwd() / file
