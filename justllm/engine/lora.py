"""The engine's LoRA adapters: loaded once, chosen per request, applied per step.

Each adapter gets an id that is never reused, so a request's adapter set (``Request.lora``,
pairs of id and scale) names exactly the weights its KV was computed under, even after an
adapter of the same name is unloaded and another loaded. The registry counts the live requests
of each adapter: an adapter being unloaded takes no new requests and is freed only once the
last of its requests has ended (its prefix-cache tree is dropped first).

llama.cpp applies adapters to the whole context (``llama_set_adapters_lora``); ``apply`` is
called with each step's set and calls llama.cpp only when the set changes (counted as a
switch: llama.cpp then builds a new compute graph). Guarded by the engine's lock; everything
that calls llama.cpp (``load``, ``apply``, ``finish_unload``) runs on the engine thread.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass

from justllm.core.request import LoraKey
from justllm.engine.backend import LlamaBackend, LoraAdapter
from justllm.errors import InvalidRequestError, ModelLoadError
from justllm.models.lora import check_lora_file


@dataclass
class LoadedLora:
    id: int
    name: str
    path: str
    scale: float  # the scale a request that names it without one runs at
    adapter: LoraAdapter
    unloading: bool = False


class LoraRegistry:
    def __init__(self, backend: LlamaBackend) -> None:
        self.backend = backend
        self.architecture = backend.metadata().get("general.architecture", "?")
        self._by_name: dict[str, LoadedLora] = {}
        self._by_id: dict[int, LoadedLora] = {}
        self._ids = itertools.count()
        self._in_use: Counter[int] = Counter()  # adapter id -> live requests
        self._applied: LoraKey = ()
        self.switches = 0  # changes of the context's adapter set

    # ---- loading ----------------------------------------------------------------------------

    def check(self, name: str, path: str, replacing: bool = False) -> None:
        """What can be checked without llama.cpp (off the engine thread): the name is free
        (unless ``replacing``; an adapter being unloaded has given its name up: every listing
        says it is gone) and the file is an adapter for this model's architecture."""
        if self.get(name) is not None and not replacing:
            raise InvalidRequestError(f"a LoRA adapter named '{name}' is loaded already",
                                      param="lora_name")
        check_lora_file(path, self.architecture)

    def load(self, name: str, path: str, scale: float = 1.0) -> LoadedLora:
        """Load an adapter (ModelLoadError if the file or llama.cpp refuses it)."""
        lora, _ = self.replace(name, path, scale, replacing=False)
        return lora

    def replace(self, name: str, path: str, scale: float = 1.0, *,
                replacing: bool = True) -> tuple[LoadedLora, int | None]:
        """Load an adapter under ``name`` in place of the one loaded under it, if any, which
        takes no new request from now on (``begin_unload``): its id, to free once its requests
        have ended. Nothing changes when the file or llama.cpp refuses the new one."""
        # The path the file check read is the one llama.cpp opens: a "~/a.gguf" passed the
        # check (expanded) and llama.cpp, given it as written, could not open it.
        path = os.path.expanduser(path)
        self.check(name, path, replacing)
        adapter = self.backend.load_lora(path)
        old = self._by_name.get(name)
        lora = LoadedLora(next(self._ids), name, path, scale, adapter)
        self._by_name[name] = lora
        self._by_id[lora.id] = lora
        if old is None:
            return lora, None
        old.unloading = True
        return lora, old.id

    def adapters(self) -> list[LoadedLora]:
        """Loaded adapters, being-unloaded ones left out, in load order."""
        return [a for a in self._by_id.values() if not a.unloading]

    def get(self, name: str) -> LoadedLora | None:
        lora = self._by_name.get(name)
        return None if lora is None or lora.unloading else lora

    # ---- requests -----------------------------------------------------------------------

    def key_for(self, choice: tuple[tuple[str, float], ...]) -> LoraKey:
        """The adapter set for a request's ``(name, scale)`` pairs; zero scales are left out
        (llama.cpp does the same: the request then runs as the base model)."""
        pairs = []
        for name, scale in choice:
            lora = self.get(name)
            if lora is None:
                loaded = ", ".join(a.name for a in self.adapters()) or "none"
                raise InvalidRequestError(f"no LoRA adapter named '{name}' is loaded "
                                          f"(loaded: {loaded})", param="lora")
            if scale != 0:
                pairs.append((lora.id, float(scale)))
        return tuple(sorted(pairs))

    def label(self, key: LoraKey) -> str:
        """The adapter names of a set, for metrics ("" for the base model)."""
        return "+".join(self._by_id[i].name for i, _ in key if i in self._by_id)

    def acquire(self, key: LoraKey) -> None:
        for i, _ in key:
            self._in_use[i] += 1

    def release(self, key: LoraKey) -> None:
        for i, _ in key:
            self._in_use[i] -= 1
            if self._in_use[i] <= 0:
                del self._in_use[i]

    # ---- steps --------------------------------------------------------------------------

    def apply(self, key: LoraKey) -> None:
        """Make ``key`` the context's adapter set for the next decode."""
        if key == self._applied:
            return
        self.backend.set_loras(tuple((self._by_id[i].adapter, s) for i, s in key))
        self._applied = key
        self.switches += 1

    # ---- unloading ----------------------------------------------------------------------

    def begin_unload(self, name: str) -> int:
        """Refuse new requests for ``name`` from now on; returns its id."""
        lora = self._by_name.get(name)
        if lora is None or lora.unloading:
            raise InvalidRequestError(f"no LoRA adapter named '{name}' is loaded",
                                      param="lora_name")
        lora.unloading = True
        return lora.id

    def busy(self, lora_id: int) -> bool:
        """Live requests still run under the adapter."""
        return self._in_use[lora_id] > 0

    def finish_unload(self, lora_id: int) -> None:
        """Free the adapter (no request of it is left; the caller dropped its cached KV)."""
        lora = self._by_id.get(lora_id)
        if lora is None:
            return
        if self.busy(lora_id):
            raise ModelLoadError(f"LoRA adapter '{lora.name}' is still in use")
        if any(i == lora_id for i, _ in self._applied):
            self.backend.set_loras(())
            self._applied = ()
        self.backend.free_lora(lora.adapter)
        del self._by_id[lora_id]
        if self._by_name.get(lora.name) is lora:  # not replaced by a newer one of its name
            del self._by_name[lora.name]
