"""Read a HF checkpoint directory into the generic model, tensor by tensor, and write one back."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moerl.bridges.base import Bridge, HFConfig, Rule, match
from moerl.bridges.multimodal import is_multimodal, text_config, text_name
from moerl.bridges.quantized import dequantize, pairs, quantization
from moerl.errors import CheckpointError
from moerl.model.config import ModelConfig
from moerl.model.moe import EXPERT_WEIGHTS
from moerl.model.size import check_buildable, check_fits
from moerl.model.swap import state_of
from moerl.model.transformer import MoEModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


MAX_JSON_BYTES = 64 << 20  # a checkpoint's JSON files (config, index, tokenizer) are far smaller: read no more


def _special_float(obj: dict):
    """transformers writes inf / nan in config.json as ``{"__float__": "Infinity"}`` (Granite-4.0-H's time_step_limit):
    the float again."""
    return float(obj["__float__"]) if obj.keys() == {"__float__"} else obj


def loads_config(text: str | bytes):
    """JSON of a checkpoint's config as transformers wrote it (its special floats read back)."""
    return json.loads(text, object_hook=_special_float)


def _read_json(file: Path):
    """A checkpoint's JSON file, bounded: a file larger than any real one is refused before it is read, and one that
    is not a regular file (a link to ``/dev/zero``, a FIFO) is not read at all."""
    if not file.is_file():
        raise CheckpointError(f"{file} is not a regular file (a device, a FIFO?); a checkpoint's JSON file is one")
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{file} has {size} bytes; a checkpoint's JSON file has at most {MAX_JSON_BYTES}")
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # a file that grew after the check is still bounded
        if len(data) > MAX_JSON_BYTES:
            raise CheckpointError(f"{file} holds more than {MAX_JSON_BYTES} bytes; a checkpoint's JSON file does not")
        return loads_config(data.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise CheckpointError(f"{file} is JSON nested too deep to read") from None


def read_config(path: str | os.PathLike) -> dict:
    """config.json of a HF checkpoint directory, with clear errors for a bad path or file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} does not exist: not a Hugging Face checkpoint directory")
    hf = _read_json(cfg_file)
    if not isinstance(hf, dict):  # every reader of a config asks it for fields by name
        raise CheckpointError(f"{cfg_file} holds a JSON {_json_kind(hf)}; a model's config.json is an object")
    if is_multimodal(hf):  # its language model: moerl.bridges.multimodal
        return text_config(hf, str(cfg_file))
    return hf


def _json_kind(value) -> str:
    """JSON's name for the kind of a parsed ``value`` (array, string, ...)."""
    kinds = ((bool, "true / false"), (list, "array"), (str, "string"), (int | float, "number"), (type(None), "null"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "object")


def _renamer(path: Path):
    """How the tensors of checkpoint ``path`` are named for the bridge: a multimodal checkpoint's language-model
    tensors as the text checkpoint's (the others: None, skipped); else as stored."""
    hf = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    return text_name if isinstance(hf, dict) and is_multimodal(hf) else (lambda name: name)


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer (``AutoTokenizer.from_pretrained``). A missing or malformed one is a
    CheckpointError naming the file and the cause, not a traceback from deep inside transformers."""
    path = Path(path)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise CheckpointError(f"{path} has no tokenizer (tokenizer_config.json or tokenizer.json)")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        file = path / name
        if file.exists():
            _read_json(file)
    if (path / "config.json").exists():  # transformers finds the tokenizer's class through it: a bad one is named
        read_config(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises anything from KeyError to TypeError on bad files
        file = path / "tokenizer.json" if (path / "tokenizer.json").exists() else path / "tokenizer_config.json"
        raise CheckpointError(f"{file}: cannot load the tokenizer: {type(e).__name__}: {e}") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        for f in dict.fromkeys(weight_map.values()):  # file names in this directory only: never a path out of it
            if Path(f).is_absolute() or ".." in Path(f).parts:
                raise CheckpointError(
                    f"{index} lists the weight file {f!r}, outside the checkpoint directory {path}; refused"
                )
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f.name} is listed in {index.name} but does not exist in {path}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")


def iter_tensors(path: Path, reads: list | None = None) -> Iterator[tuple[str, Path, callable]]:
    """(name, file, loader) for every tensor (named for the bridge: ``_renamer``); the loader reads that one tensor
    only, or (``loader(rows)``, rows a slice) only those rows of its first dim. ``reads`` gets (name, bytes) of each
    read."""
    rename = _renamer(path)
    for file in _weight_files(path):
        try:
            handle = safe_open(file, framework="pt")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
        for name in names:
            if (ours := rename(name)) is None:
                continue

            def load(rows: slice | None = None, handle=handle, name=name, file=file, ours=ours):
                try:
                    t = handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
                except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                    raise CheckpointError(f"tensor {name!r} in {file} cannot be read (corrupt file?): {e}") from None
                if reads is not None:
                    reads.append((ours, t.numel() * t.element_size()))
                return t

            yield ours, file, load


def unfused(bridge: Bridge, name: str, load, cfg: ModelConfig) -> list[tuple[str, callable]]:
    """(name, loader) of each tensor checkpoint tensor ``name`` holds: its parts when the bridge stores it fused
    (``Fused``; the tensor is read once for all of them), else itself."""
    for f in bridge.fused:
        groups = match(f._hf_re, name)
        if groups is not None:
            cache: list = []

            def part(j: int, rows: slice | None = None, f=f):
                if not cache:
                    cache.extend(f.split(load() if rows is None else load(rows), cfg))
                return cache[j]

            return [(p.format(**groups), partial(part, j)) for j, p in enumerate(f.parts)]
    return [(name, load)]


def fused(bridge: Bridge, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``tensors`` (checkpoint names) with each complete set of a ``Fused``'s parts joined into its tensor."""
    for f in bridge.fused:
        for name in list(tensors):
            groups = match(f._parts_re[0], name)
            if groups is None:
                continue
            names = [p.format(**groups) for p in f.parts]
            if all(n in tensors for n in names):
                tensors[f.hf.format(**groups)] = f.join([tensors.pop(n) for n in names], cfg)
    return tensors


def stored_as(bridge: Bridge, name: str) -> str:
    """The checkpoint name tensor ``name`` is stored under: its fused tensor's, when the bridge fuses it."""
    for f in bridge.fused:
        for part in f._parts_re:
            groups = match(part, name)
            if groups is not None:
                return f.hf.format(**groups)
    return name


def _destination(
    params: dict, rule: Rule, groups: dict, shares: dict[str, range] | None = None
) -> tuple[str, torch.Tensor | None] | None:
    """(moerl name, destination view) of a checkpoint tensor, None where no parameter takes it; the view is None for
    an expert outside the share its parameter holds (``shares``: name -> the experts held)."""
    target = rule.moerl.format(**rule.moerl_groups(groups))
    if target not in params:
        return None
    dest = params[target]
    if "e" in groups:
        e, share = int(groups["e"]), (shares or {}).get(target)
        if share is not None:
            if e not in share:
                return target, None
            e -= share.start
        if e >= dest.shape[0]:
            return None
        dest = dest[e]
    if rule.part:
        half = dest.shape[-2] // 2
        dest = dest[..., :half, :] if rule.part == "gate" else dest[..., half:, :]
    return target, dest


def resolve(
    bridge: Bridge, params: dict, name: str, shares: dict[str, range] | None = None
) -> tuple[Rule, dict, str, torch.Tensor | None] | None:
    """(rule, placeholder values, moerl parameter name, destination view) for HF tensor ``name``, or None; the view
    is None for an expert another rank holds (``shares``, see ``_destination``)."""
    for rule in bridge.all_rules:
        groups = match(rule._hf_re, name)
        if groups is not None and (place := _destination(params, rule, groups, shares)):
            return rule, groups, *place
    return None


def _header_shapes(path: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor's (file, shape), from the safetensors headers only."""
    out, rename = {}, _renamer(path)
    for file in _weight_files(path):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    if (ours := rename(name)) is not None:
                        out[ours] = (file, tuple(handle.get_slice(name).get_shape()))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    return out


def check_shapes(path: Path, bridge: Bridge, cfg: ModelConfig, params: dict, hf: dict) -> None:
    """Every tensor of checkpoint ``path`` has a place in ``params`` (meta tensors do) and the shape it takes,
    judged from the safetensors headers: before a byte of weights is allocated or read. Quantized pairs are checked
    when they are read."""
    shapes = _header_shapes(path)
    _, consumed = pairs(list(shapes), quantization(hf, str(path / "config.json")))
    for whole, (file, whole_shape) in shapes.items():
        if whole in consumed:
            continue
        try:
            parts = unfused(bridge, whole, lambda s=whole_shape: torch.empty(s, device="meta"), cfg)
            parts = [(n, tuple(load().shape)) for n, load in parts]
        except Exception:  # noqa: BLE001 - a fused tensor of a shape its split cannot take: checked as it is read
            continue
        for name, shape in parts:
            if bridge.ignore(name, cfg) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            rule, target, dest = _place(bridge, params, name, file, hf)
            if rule.load is not None:
                try:
                    shape = tuple(rule.load(torch.empty(shape, device="meta"), cfg).shape)
                except Exception:  # noqa: BLE001 - a transform meta tensors cannot take: checked as it is read
                    continue
            _check_shape(name, file, shape, dest, target)


def _place(
    bridge: Bridge, params: dict, name: str, file: Path, hf: dict, shares: dict[str, range] | None = None
) -> tuple[Rule, str, torch.Tensor | None]:
    """(rule, moerl parameter name, destination view) of checkpoint tensor ``name``; CheckpointError if none."""
    place = resolve(bridge, params, name, shares)
    if place is None:
        raise CheckpointError(
            f"unexpected tensor {name!r} in {file.name}: no parameter of this "
            f"{hf.get('architectures', ['?'])[0]} model (config.json) takes it"
        )
    rule, _, target, dest = place
    return rule, target, dest


def _check_shape(name: str, file: Path, shape: tuple, dest: torch.Tensor, target: str) -> None:
    if tuple(shape) != tuple(dest.shape):
        raise CheckpointError(
            f"tensor {name!r} in {file.name} has shape {tuple(shape)}, the model expects {tuple(dest.shape)} "
            f"(for {target})"
        )


def _dequantized(q: dict, name: str, data, scales) -> torch.Tensor:
    return dequantize(q, name, data(), scales())


def expert_share(num_experts: int, rank: int, ranks: int) -> range:
    """The experts rank ``rank`` of ``ranks`` expert-parallel ranks holds: a contiguous ``num_experts // ranks``."""
    n = num_experts // ranks
    return range(rank * n, rank * n + n)


def _keep_share(model: MoEModel, share: range) -> dict[str, range]:
    """Cut every MoE layer's per-expert tensors (meta, not yet allocated) to the experts of ``share``; returns the
    names of those cut, each with its share."""
    out = {}
    for i in model.moe_layer_ids:
        experts = model.layers[i].mlp.experts
        for attr in EXPERT_WEIGHTS:
            p = getattr(experts, attr, None)
            if p is not None:
                setattr(experts, attr, torch.nn.Parameter(p.narrow(0, share.start, len(share)), p.requires_grad))
                out[f"layers.{i}.mlp.experts.{attr}"] = share
    return out


def read_model(
    path: str | os.PathLike,
    bridge: Bridge,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    experts: tuple[int, int] | None = None,
    reads: list | None = None,
    keep: Callable[[MoEModel], object] | None = None,
) -> MoEModel:
    """Read a HF checkpoint directory (single or sharded safetensors) into a MoEModel through ``bridge`` (which
    bridge a checkpoint takes: ``moerl.bridges.find``).

    The model is allocated once, empty, and each checkpoint tensor is copied into its place as it is read
    (per-expert tensors into their slice of the 3D experts), so no second full copy is held. Quantized checkpoints
    (FP8 blocks, MXFP4 experts: ``moerl.bridges.quantized``) are dequantized tensor by tensor on the way.

    ``experts`` = (rank, ranks): the model holds only that expert-parallel rank's share of every layer's experts
    (``expert_share``) and reads only it: a per-expert tensor of another rank's expert is never opened, a tensor of
    all experts is read by its rows (a quantized one whole, then cut). ``keep(model)``, called on the model while it
    is still on the meta device, removes what this rank does not hold (e.g. other pipeline stages' layers:
    ``moerl.parallel.pipeline.HeldStages``): those tensors are neither allocated nor read. ``reads`` gets (name,
    bytes) of each read.
    """
    path = Path(path)
    hf = read_config(path)
    q = quantization(hf, str(path / "config.json"))
    cfg = bridge.config_from_hf(HFConfig(hf, str(path / "config.json")))
    check_buildable(cfg)
    with torch.device("meta"):
        model = MoEModel(cfg, dtype)
    whole = dict(model.named_parameters()) | dict(model.named_buffers())  # every tensor at its checkpoint shape
    shares = _keep_share(model, expert_share(cfg.num_experts, *experts)) if experts is not None else {}
    if keep is not None:
        keep(model)
    check_fits(model, device, str(path))  # what this process holds
    check_shapes(path, bridge, cfg, whole, hf)
    model.to_empty(device=device)
    model.init_rope()
    model.hf_config = hf
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    places = whole | params  # a tensor another rank holds resolves to its meta tensor, and is skipped
    filled = dict.fromkeys(params, 0)
    seen: set[str] = set()
    entries = list(iter_tensors(path, reads))
    quantized, consumed = pairs([name for name, _, _ in entries], q)
    loaders = {name: load for name, _, load in entries}
    firsts = {data: logical for logical, (data, _) in quantized.items()}
    with torch.no_grad():
        for name, file, load in entries:
            rows = True  # a tensor of all experts is read by the rows of this rank's share
            if name in consumed:  # one half of a quantized pair: read with its partner, under the logical name
                if name not in firsts:
                    continue
                name, (data, scale) = firsts[name], quantized[firsts[name]]
                load, rows = partial(_dequantized, q, name, loaders[data], loaders[scale]), False
            for part, read in unfused(bridge, name, load, cfg):  # a fused tensor: its parts
                if bridge.ignore(part, cfg) or (cfg.tie_word_embeddings and part == "lm_head.weight"):
                    continue
                rule, target, dest = _place(bridge, places, part, file, hf, shares)
                if dest is None or target not in params:  # an expert or a layer another rank holds
                    seen.add(part)
                    continue
                share = shares.get(target) if dest.dim() == params[target].dim() else None  # all experts
                if share is None:
                    tensor = read()
                elif rows:
                    tensor = read(slice(share.start, share.stop))
                else:
                    tensor = read().narrow(0, share.start, len(share))
                if rule.load is not None:
                    tensor = rule.load(tensor, cfg)
                _check_shape(part, file, tensor.shape, dest, target)
                dest.copy_(tensor)
                filled[target] += dest.numel()
                seen.add(part)
    missing = [
        stored_as(bridge, hf_name)
        for target, n in filled.items()
        if n < params[target].numel()
        for hf_name, _ in to_hf(bridge, target, params[target], cfg, shares.get(target))
        if hf_name not in seen
    ]
    missing = list(dict.fromkeys(missing))  # a fused tensor's parts: named once
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensor(s) in {path}: {', '.join(missing[:5])}{more}")
    return model


def moerl_rules(bridge: Bridge, name: str) -> list[tuple[Rule, dict]]:
    """The rules (and their HF names' placeholder values) that write moerl parameter ``name``: the bridge's own, else
    the common."""
    own = [
        (r, h)
        for r in bridge.rules
        if r.write and (g := match(r._moerl_re, name)) is not None and (h := r.hf_groups(g)) is not None
    ]
    if not own:
        common = bridge.all_rules[len(bridge.rules) :]
        own = [next((r, g) for r in common if (g := match(r._moerl_re, name)) is not None)]
    return own


def to_hf(bridge: Bridge, name: str, tensor: torch.Tensor, cfg: ModelConfig, experts: range | None = None):
    """(hf_name, tensor) pairs that hold moerl parameter ``name`` (``cfg``: the model's config, for transforms).
    ``experts``: the experts ``tensor``'s first dim holds (an expert-parallel slice), default all of them."""
    for rule, groups in moerl_rules(bridge, name):
        ids = list(enumerate(experts or range(tensor.shape[0]))) if "{e}" in rule.hf else [(None, None)]
        for i, e in ids:
            t = tensor if e is None else tensor[i]
            if rule.part:
                half = t.shape[-2] // 2
                t = t[..., :half, :] if rule.part == "gate" else t[..., half:, :]
            if rule.save is not None:
                t = rule.save(t, cfg)
            yield rule.hf.format(**groups, **({} if e is None else {"e": e})), t


def names_held(
    bridge: Bridge, cfg: ModelConfig, params: dict[str, torch.Tensor], experts: dict[str, range] | None = None
) -> list[str]:
    """The checkpoint's tensor names that hold ``params`` (moerl name -> this rank's part; meta tensors are enough):
    what a rank holding them opens of a sharded checkpoint, e.g. one pipeline stage's layers, and of a name in
    ``experts`` (an expert-parallel slice) only those experts' tensors. Adapters are not in a base checkpoint."""
    out: dict[str, None] = {}
    for name, t in params.items():
        if ".lora." not in name:
            out |= dict.fromkeys(hf for hf, _ in to_hf(bridge, name, t, cfg, (experts or {}).get(name)))
    return list(out)


def files_held(directory: str | os.PathLike, names: list[str]) -> list[str]:
    """The files of checkpoint ``directory`` that hold tensors ``names`` (a sharded checkpoint's index read;
    a single-file checkpoint is that file). A name the checkpoint lacks is a CheckpointError naming it."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return ["model.safetensors"]
    weight_map = _read_json(index).get("weight_map", {})
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise CheckpointError(f"{index}: no tensor {missing[0]!r} (and {len(missing) - 1} more) in its weight_map")
    return sorted({weight_map[n] for n in names})


def _span(t: torch.Tensor, hf_name: str) -> tuple[int, int, int, str]:
    """(storage, first byte, end byte, name) of contiguous tensor ``t``: the memory it is written from."""
    return t.untyped_storage().data_ptr(), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), hf_name


def _refuse_overlaps(bridge: Bridge, spans: list[tuple[int, int, int, str]], written_from: dict[str, str]) -> None:
    """Refuse, naming both names, two checkpoint tensors that share memory (``_span``s): one moerl tensor a bridge's
    rules write twice (e.g. per expert and whole), which safetensors would refuse only once the old files were gone.
    Sorted by start, any overlap shows between neighbours."""
    order = {name: i for i, (*_, name) in enumerate(spans)}
    spans = sorted(spans)
    clashes = [
        (first, second)
        for (storage, _, stop, first), (next_storage, start, _, second) in zip(spans, spans[1:], strict=False)
        if storage == next_storage and start < stop
    ]
    if clashes:
        # Memory addresses order the search; the export's own order picks the one named, the same on every run.
        first, second = min(clashes, key=lambda c: max(order[c[0]], order[c[1]]))
        first, second = sorted((first, second), key=order.get)
        source = written_from.get(second, second)
        raise CheckpointError(
            f"{bridge.architectures[0]} export: moerl tensor {source!r} would be written twice, as {first!r} "
            f"and as {second!r} (two of the bridge's rules write it); nothing was written"
        )


def write_model(
    model: MoEModel,
    bridge: Bridge,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` as a HF checkpoint directory through ``bridge``: config.json, (sharded) safetensors, tokenizer
    files.

    ``state_dict`` replaces the model's own weights (e.g. with LoRA merged in); LoRA tensors are never written.
    """
    out = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    state = state_of(model) if state_dict is None else state_dict
    written_from: dict[str, str] = {}  # checkpoint name -> the moerl tensor it holds (to name a clash)
    tensors, spans = {}, []
    for name, tensor in state.items():
        if ".lora." not in name:
            for hf_name, t in to_hf(bridge, name, tensor.detach(), model.config):
                tensors[hf_name], written_from[hf_name] = t, name
    if bridge.export_extra is not None:
        tensors |= bridge.export_extra(tensors, model.config)
    for hf_name, t in fused(bridge, tensors, model.config).items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        whole = t.contiguous()
        if whole.numel() and whole.data_ptr() == t.data_ptr():  # the state's own memory, not a copy: may be shared
            spans.append(_span(whole, hf_name))
        shards[-1][hf_name] = whole.cpu()
        size += nbytes
    _refuse_overlaps(bridge, spans, written_from)  # before the old files go: a refused export loses nothing
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata=meta)
    else:
        weight_map, total = {}, 0
        for n, shard in enumerate(shards, 1):
            fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / fname, metadata=meta)
            weight_map |= dict.fromkeys(shard, fname)
            total += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = dict(model.hf_config)
    hf.pop("quantization_config", None)  # the weights are written dequantized
    hf["dtype"] = str(model.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / f
            if src.exists() and src.resolve() != (out / f).resolve():
                shutil.copy(src, out / f)
    return out
