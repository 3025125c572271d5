"""llama.cpp's own Hugging Face to GGUF converter, fetched at run time, never copied into justllm.

The converter (``convert_hf_to_gguf.py``, its ``conversion/`` package, the ``gguf-py``
library it writes with and the chat templates it may embed) must match the llama.cpp that loads its output. That llama.cpp is the
one inside the installed llama-cpp-python, whose sdist vendors the whole llama.cpp tree. So on
first use ``fetch_converter`` asks pip (with the user's own pip configuration: index, proxy,
certificates) for that exact version's sdist and extracts only the converter's files into
``CACHE/converter/llama-cpp-python-VERSION/``; a later llama-cpp-python gets a folder of its
own. The extraction lands in a temporary folder renamed into place under a lock, so two
commands fetching at once, or one interrupted, never leave a half tree.

``architectures`` reads what the converter supports from its registry of model classes
(``TEXT_MODEL_MAP`` in ``conversion/__init__.py``; older trees: the ``@ModelBase.register``
decorators) without importing it, so an unsupported model is refused before torch loads.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from justllm.errors import JustLLMError, ModelLoadError

PACKAGE = "llama-cpp-python"
# Paths inside the sdist's vendor/llama.cpp that the converter needs (the chat templates some
# model classes write into the GGUF among them), and its licence.
CONVERTER_FILES = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/",
                   "gguf-py/gguf/", "models/templates/", "LICENSE")
SCRIPT = "convert_hf_to_gguf.py"
LORA_SCRIPT = "convert_lora_to_gguf.py"  # a PEFT LoRA adapter to llama.cpp's adapter GGUF
# What the converter imports beyond justllm's own dependencies: the `convert` extra.
CONVERTER_MODULES = ("torch", "transformers", "sentencepiece")
INSTALL_HINT = "pip install 'justllm[convert]' (pipx: pipx install --force 'justllm[convert]')"


class MissingExtraError(JustLLMError):
    """The converter's Python dependencies (the ``convert`` extra) are not installed."""


def check_extra() -> None:
    """Raise MissingExtraError naming what is missing; looks, does not import (torch takes
    seconds). A test hides a module with ``sys.modules[name] = None``, which this honours."""
    missing = [m for m in CONVERTER_MODULES if _find(m) is None]
    if missing:
        raise MissingExtraError(f"converting needs {', '.join(missing)} (not installed): "
                                f"{INSTALL_HINT}")


def _find(module: str) -> object | None:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def llama_cpp_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"{PACKAGE} is not installed, so there is no llama.cpp version "
                             "to match the converter to") from None


@dataclass(frozen=True)
class Converter:
    """An extracted converter tree: ``root/convert_hf_to_gguf.py`` and its packages."""

    root: Path
    version: str  # the llama-cpp-python release it came from

    @property
    def script(self) -> Path:
        return self.root / SCRIPT

    @property
    def lora_script(self) -> Path:
        return self.root / LORA_SCRIPT

    def architectures(self) -> tuple[str, ...]:
        """The Hugging Face ``architectures`` names the converter turns into a text model."""
        return supported_architectures(self.root)


def converter_dir(root: Path, version: str) -> Path:
    return root / f"{PACKAGE}-{version}"


Downloader = Callable[[str, Path], Path]


def fetch_converter(root: Path, *, version: str | None = None,
                    download: Downloader | None = None,
                    on_fetch: Callable[[str], None] | None = None) -> Converter:
    """The converter of llama-cpp-python ``version`` (default: the installed one) under
    ``root``, fetched first if it is not there. ``download(version, into) -> sdist path``
    (default: ``pip download``); ``on_fetch(message)`` is told before a fetch starts."""
    from justllm.models.manifest import file_lock

    version = version or llama_cpp_version()
    target = converter_dir(root, version)
    if is_complete(target):
        return Converter(target, version)
    with file_lock(root / ".lock"):
        if is_complete(target):  # another command fetched it meanwhile
            return Converter(target, version)
        if on_fetch is not None:
            on_fetch(f"fetching llama.cpp's converter from the {PACKAGE} {version} sdist "
                     f"(once; it is kept in {root})")
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as tmp:
            sdist = (download or pip_download)(version, Path(tmp))
            tree = Path(tmp) / "tree"
            extract_converter(sdist, tree)
            if target.exists():
                shutil.rmtree(target)  # a tree from an older justllm that lacks a script
            tree.rename(target)
    return Converter(target, version)


def is_complete(tree: Path) -> bool:
    """Both scripts are there (a tree fetched by an older justllm lacks the LoRA one)."""
    return (tree / SCRIPT).is_file() and (tree / LORA_SCRIPT).is_file()


def pip_download(version: str, into: Path) -> Path:
    """``pip download`` of the sdist (pip's own index, proxy and certificate settings apply).
    pip also prepares the sdist's metadata, which installs its build backend in a throwaway
    environment: about 20 s in all, once per llama-cpp-python version."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
           "--disable-pip-version-check", "--quiet", "-d", str(into), f"{PACKAGE}=={version}"]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"cannot fetch llama.cpp's converter: pip download failed ({e})") \
            from None
    found = sorted(into.glob("*.tar.gz"))
    if r.returncode != 0 or not found:
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower()),
                   lines[-1] if lines else f"exit code {r.returncode}")
        raise ModelLoadError(f"cannot fetch llama.cpp's converter: pip download "
                             f"{PACKAGE}=={version} --no-binary {PACKAGE} failed: {why}")
    return found[0]


def extract_converter(sdist: Path, into: Path) -> None:
    """Copy the converter's files out of the sdist's ``vendor/llama.cpp`` into ``into``;
    only regular files, only below the wanted paths (nothing in the archive can write
    elsewhere)."""
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            count = 0
            for member in tar:
                rel = _converter_path(member.name)
                if rel is None or not member.isfile():
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                dest = into.joinpath(*rel.parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with src, dest.open("wb") as out:
                    shutil.copyfileobj(src, out)
                count += 1
    except (OSError, tarfile.TarError) as e:
        raise ModelLoadError(f"cannot extract llama.cpp's converter from {sdist.name}: {e}") \
            from None
    if count == 0 or not (into / SCRIPT).is_file():
        raise ModelLoadError(f"{sdist.name} holds no vendor/llama.cpp/{SCRIPT}")


def _converter_path(name: str) -> PurePosixPath | None:
    """``TOP/vendor/llama.cpp/REL`` -> ``REL`` when REL is one of the converter's files."""
    parts = PurePosixPath(name).parts
    if len(parts) < 4 or parts[1:3] != ("vendor", "llama.cpp") or ".." in parts:
        return None
    rel = PurePosixPath(*parts[3:])
    text = rel.as_posix()
    for wanted in CONVERTER_FILES:
        if text == wanted or (wanted.endswith("/") and text.startswith(wanted)):
            return None if "__pycache__" in rel.parts else rel
    return None


def supported_architectures(root: Path) -> tuple[str, ...]:
    """Sorted ``architectures`` names of the text models the converter at ``root`` knows."""
    init = root / "conversion" / "__init__.py"
    if init.is_file():
        names = _dict_keys(init, "TEXT_MODEL_MAP")
        if names:
            return tuple(sorted(names))
    found: set[str] = set()
    for path in [root / SCRIPT, *sorted((root / "conversion").glob("*.py"))]:
        if path.is_file():
            found |= _registered(path)
    return tuple(sorted(found))


def _dict_keys(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        target: ast.expr
        expr: ast.expr | None
        if isinstance(node, ast.AnnAssign):
            target, expr = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, expr = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == name and expr is not None:
            value = ast.literal_eval(expr)
            if isinstance(value, dict):
                return {str(k) for k in value}
    return set()


def _registered(path: Path) -> set[str]:
    """The names in ``@ModelBase.register("A", "B")`` decorators (older converters)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ClassDef):
            continue
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and dec.func.attr == "register"):
                names |= {a.value for a in dec.args
                          if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return names
