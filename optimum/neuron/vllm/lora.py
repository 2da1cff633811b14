"""vLLM's LoRA requests (``--enable-lora``) on the engine's adapter slots (``--max_loras``, `runtime.adapters`).

vLLM's front end knows adapters by ``LoRARequest`` (an id, a name, a PEFT folder: ``--lora-modules``, or
``/v1/load_lora_adapter``) and its scheduler puts at most ``--max-loras`` distinct adapters among the running requests.
The worker keeps the requests it was told of (`add`, `remove`, `pin`, `ids`), and when a request on an adapter is
admitted, makes sure that adapter sits in a slot (`slot_name`): loaded from its folder into a free slot, or into the
slot of the least recently used adapter no admitted request runs on (and not pinned). Loading copies into the tensors
every graph binds, so it costs no recompilation, only the read of the adapter; the ``--max-cpu-loras`` adapters used
last are kept read in host memory, so one evicted from its slot comes back without reading its folder again.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path

from ..errors import InputError
from ..runtime.adapters import AdapterParts
from ..runtime.engine import Engine
from .compat import LoraAdapter


class VllmAdapters:
    """The adapters vLLM told the worker of, and which of them sit in the engine's slots."""

    def __init__(self, engine: Engine, host_capacity: int = 0) -> None:
        """``host_capacity``: how many read adapters to keep in host memory (vLLM's ``--max-cpu-loras``; 0: none)."""
        self.engine = engine
        self.host_capacity = host_capacity
        self.host: OrderedDict[int, AdapterParts] = OrderedDict()
        """Adapter id -> the adapter as read, the most recently used last."""
        self.known: dict[int, LoraAdapter] = {}
        self.pinned: set[int] = set()
        self._used: dict[int, int] = {}
        """Adapter id -> when a request last asked for it (a counter): the eviction order."""
        self._clock = itertools.count()

    @staticmethod
    def name(lora_id: int) -> str:
        """The engine's name for vLLM's adapter ``lora_id``."""
        return f"vllm-lora-{lora_id}"

    def add(self, adapter: LoraAdapter) -> bool:
        """Remember ``adapter`` (vLLM's ``add_lora``); it is loaded into a slot when a request runs on it."""
        self.known[adapter.lora_id] = adapter
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget ``lora_id`` and free its slot (vLLM's ``remove_lora``); False while a request runs on it."""
        if self.name(lora_id) in self.engine.adapters.loaded:
            try:
                self.engine.unload_adapter(self.name(lora_id))
            except InputError:
                return False
        self.pinned.discard(lora_id)
        self.host.pop(lora_id, None)
        return self.known.pop(lora_id, None) is not None

    def pin(self, lora_id: int) -> bool:
        """Never evict ``lora_id`` from its slot once loaded (vLLM's ``pin_lora``)."""
        self.pinned.add(lora_id)
        return lora_id in self.known

    def ids(self) -> set[int]:
        """The adapters the worker knows (vLLM's ``list_loras``)."""
        return set(self.known)

    def slot_name(self, adapter: LoraAdapter) -> str:
        """The engine's name of ``adapter``, loaded into a slot first if it is not (evicting the least recently used
        adapter no admitted request runs on when every slot is taken). `InputError` when it cannot be loaded."""
        self.known.setdefault(adapter.lora_id, adapter)
        name = self.name(adapter.lora_id)
        if name not in self.engine.adapters.loaded:
            if len(self.engine.adapters.loaded) >= self.engine.config.max_loras:
                self._evict()
            self.engine.load_adapter(name, self._read(adapter))
        self._used[adapter.lora_id] = next(self._clock)
        return name

    def _read(self, adapter: LoraAdapter) -> AdapterParts:
        """``adapter`` as read from its folder, or from host memory when it was read lately (then kept there, the
        least recently used of more than `host_capacity` dropped)."""
        parts = self.host.pop(adapter.lora_id, None)
        if parts is None:
            parts = self.engine.adapters.read(self.name(adapter.lora_id), Path(adapter.path))
        if self.host_capacity:
            self.host[adapter.lora_id] = parts
            while len(self.host) > self.host_capacity:
                self.host.popitem(last=False)
        return parts

    def _evict(self) -> None:
        """Unload the least recently used adapter that no admitted request runs on and is not pinned."""
        loaded = [i for i in self.known if self.name(i) in self.engine.adapters.loaded and i not in self.pinned]
        for lora_id in sorted(loaded, key=lambda i: self._used.get(i, -1)):
            try:
                self.engine.unload_adapter(self.name(lora_id))
                return
            except InputError:  # a request runs on it
                continue
        raise InputError(
            f"every one of the artifact's {self.engine.config.max_loras} adapter slots holds an adapter in use: "
            "lower --max-loras, or re-export with a larger --max_loras."
        )
