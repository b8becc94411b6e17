"""``Mode``: what a training mode decides, and the defaults (a model whose own weights train through fp32 masters)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


class Mode:
    """One training mode. Its facts (class attributes) and decisions (methods) are all the rest of moerl knows of it;
    ``policy`` arguments are a ``moerl.trainer.Policy``."""

    name = ""
    masters = True  # the model's own weights train, through fp32 masters (sharded, and gathered in the compute dtype)
    adapter_slot: int | None = None  # the engine adapter slot the policy's forwards use; None: no adapters
    untraced: str | None = None  # why torch.compile cannot trace the training forward, if it cannot
    reference_copy = True  # ``policy.reference`` keeps a whole frozen copy (every rank loads the whole model for it)

    def prepare(self, model: torch.nn.Module, cfg) -> None:
        """Make ``model`` (just loaded) this mode's: its modules, and which parameters train (``cfg``: PolicyConfig)."""

    def trained_modules(self, model: torch.nn.Module, cfg) -> None:
        """Give a fresh whole ``model`` the modules the trained state names (to copy that state into)."""

    def reference(self, model: torch.nn.Module, cfg, dtype: torch.dtype) -> torch.nn.Module | None:
        """The frozen model reference logprobs come from (``policy.reference``), in the compute dtype; None where
        the mode needs none or the run asked for none."""
        return copy.deepcopy(model).to(dtype).requires_grad_(False) if cfg.reference else None

    def engine_mx(self, cfg) -> str | None:
        """The MX scale mode an engine quantizes its weights with (None: plain weights)."""
        return None

    def check_run(self, engine: str, ranks: int) -> None:
        """Refuse a run this mode cannot make: rollouts from ``engine`` (native | vllm) with ``ranks`` trainer ranks."""

    def sends_adapter(self, dense: str | None) -> bool:
        """Whether a weight sync sends an adapter slot (``set_adapter``) rather than staged weight buckets."""
        return False

    def own_tensors(
        self, policy, dense: str | None, part_bytes: int = 256 * 2**20
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part of what a weight sync sends (``moerl.sync``), each tensor whole over the data and
        expert groups or in row parts (below): the weights in the compute dtype, routers in fp32 bit for bit,
        then the buffers. ``dense``: the dtype name of an engine that takes plain weights only (vLLM). A weight
        split over ranks by rows (FSDP's shards, expert slices) travels as row parts of at most ``part_bytes``
        (``moerl.sync.parts``), each made by the rank that holds its rows: no rank holds a whole tensor of it
        for a sync."""
        layout = policy.layout
        for name, master in policy.master.master.items():
            if name in layout.copies:  # sent by the stage that holds the original
                continue
            own = policy.master.model_params[name]
            rounded = own.dtype == policy.dtype and not isinstance(own, DTensor) and self.sends_rounded(policy, name)
            if ".router." in name:
                yield name, layout.whole(name, master.detach()).float()
            elif layout.in_rows(name, master) and _nbytes(layout.whole_shape(name, master), policy.dtype) > part_bytes:
                # split by rows over ranks, and more than a part whole: each rank's rows in turn
                if rounded:
                    yield from layout.row_parts(name, own, partial(_as_it_is, name), part_bytes)
                else:
                    form = partial(_made, self.weight_form, policy, name, dense)
                    yield from layout.row_parts(name, master, form, part_bytes)
            elif rounded:  # the rank holds round(master) already: gathered as it is, in half its master's bytes
                yield name, layout.whole(name, own.detach())
            else:
                yield from self.weight_form(policy, name, layout.whole(name, master.detach()), dense)
        for name, buf in policy.model.named_buffers():  # e.g. the selection-only router bias
            yield name, buf.detach().clone()

    def sends_rounded(self, policy, name: str) -> bool:
        """Whether a sync sends weight ``name`` as its master rounded to the compute dtype (``weight_form``'s)."""
        return True

    def weight_form(self, policy, name: str, master: torch.Tensor, dense: str | None):
        """The sync's tensors for weight ``name`` from its fp32 ``master``, whole or some of its rows (a form works
        row by row, so a sharded sync makes each rank's rows itself): the compute dtype."""
        yield name, master.to(policy.dtype)

    def export(self, policy, run_dir: Path) -> dict[str, str]:
        """Write what the run made beside its checkpoint; returns what was written by kind. Nothing by default:
        the checkpoint is the trained model."""
        return {}


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


def _as_it_is(name: str, rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, rows)]


def _made(weight_form, policy, name: str, dense: str | None, rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return list(weight_form(policy, name, rows, dense))
