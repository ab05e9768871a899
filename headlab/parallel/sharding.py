"""Models larger than one device: the weights sharded by FSDP2 across torchrun ranks.

Each transformer block is one `torch.distributed.fsdp.fully_shard` unit: its
parameters are split by rows (dim 0) across the ranks and gathered only for the
block's forward and backward; untied embeddings and head are units of their own, and
the root unit holds the rest (the final norm, tied embeddings), see `memory.units`.
The head gates and headlab's other buffers are not parameters: they stay whole on
every rank, so the gate gradients scoring reads are ordinary tensors.

Data: every rank sees every batch (`distributed.set_data_parallel(False)`). FSDP needs
every rank in every block's all-gather, so the ranks run the same batches in lockstep;
their gate gradients are then equal and summing them over ranks would count each
batch W times, so nothing is all-reduced. Sharding buys memory (parameters / W per
rank), not speed. Backend: gloo on CPU, nccl on CUDA (`distributed.init_from_env`).

    torchrun --nproc_per_node 2 -m headlab score --model DIR --shard fsdp

`load_sharded` builds the model on the meta device and has each rank read, from the
checkpoint's safetensors files (one file or an index of shards), only its own rows of
each tensor; `save_sharded` gathers one block at a time, rank 0 prunes it (given a
plan) and writes it as one safetensors file of a normal headlab directory;
`check_memory` refuses a run whose per-rank memory (`headlab.parallel.memory`) would not fit.
Layer-wise repair of a sharded model gathers one block at a time too
(`headlab.recovery.sharded`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from headlab.errors import UserError
from headlab.models import format, registry
from headlab.models.base import HeadModel
from headlab.parallel import distributed
from headlab.parallel.memory import check_memory, units
from headlab.selection import PrunePlan

SHARDING = ("fsdp",)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` went through `shard` (its class is an FSDP module)."""
    return _fsdp_class(type(model))


def _fsdp_class(cls: type) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return issubclass(cls, FSDPModule)


def shard(model: HeadModel, *, device: str | torch.device | None = None) -> HeadModel:
    """Wrap each block, then the root, with ``fully_shard`` (in place); from then on every
    rank must run the same forwards, so data parallelism is turned off. ``device``: where
    the parameters will live (default: where they are; give it for a meta model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):  # one rank is allowed: a test
        raise UserError("--shard fsdp splits the weights across torchrun processes: start "
                        "with torchrun --nproc_per_node N (N >= 2)")
    kind = torch.device(device or model.device).type
    mesh = init_device_mesh(kind, (distributed.world_size(),))
    for unit in units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    distributed.set_data_parallel(False)
    return model


@dataclass
class Reads:
    """What one rank read from a checkpoint: tensors touched and elements read."""

    tensors: int
    elements: int
    sliced: bool  # only this rank's rows (False: whole tensors, see `load_sharded`)


def load_sharded(name_or_path: str | Path, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, batch_size: int | None = None,
                 seq_len: int = 256, backward: bool = True,
                 models: int = 1) -> tuple[HeadModel, Reads]:
    """The model at ``name_or_path``, sharded, each rank holding only its rows.

    Where every headlab tensor is one checkpoint tensor renamed (headlab directories;
    the checkpoints of families registered with a weight map, `registry.Family`), the
    model is built on the meta device and each rank reads only its rows through
    safetensors slices. Elsewhere (GPT-2's fused, transposed c_attn; a GGUF file not
    yet converted; hub ids) every rank loads the whole model,
    then shards it. With ``batch_size``, `check_memory` refuses what would not fit
    (with ``models`` models of this size held per rank), before any weight is read
    (after, for a model read whole).
    """
    from headlab.models.loading import BUNDLED, bundled_path, gguf_cache_dir, load, read_tokenizer

    distributed.init_from_env(device)
    name = str(name_or_path)
    path = bundled_path(name) if name in BUNDLED else Path(name)
    if path.suffix == ".gguf" and path.is_file() and gguf_cache_dir(path).is_dir():
        path = gguf_cache_dir(path)  # headlab's conversion, written by an earlier load
    built = _built_on_meta(path) if path.is_dir() else None
    model = built[0] if built is not None else load(name_or_path, device=device, dtype=dtype)
    if batch_size is not None:
        check_memory(model, ranks=distributed.world_size(), batch_size=batch_size,
                     seq_len=seq_len, backward=backward, dtype=dtype, device=device,
                     models=models)
    if built is None:
        params = list(model.parameters())
        return shard(model), Reads(len(params), sum(p.numel() for p in params), sliced=False)
    names = built[1]
    model = model.to(dtype=dtype)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    shard(model, device=device)
    model.to_empty(device=device)
    reads = _read_rows(model, path, names, buffers, dtype)
    model.tokenizer = read_tokenizer(path)
    model.source = str(name_or_path)
    model.eval()
    return model, reads


def _built_on_meta(path: Path) -> tuple[HeadModel, dict[str, str]] | None:
    """The model of ``path`` with meta parameters (real buffers) and each headlab
    tensor's checkpoint name; None where ``path`` is no safetensors checkpoint that
    headlab's format or a registered weight map covers."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not any(path.glob("*.safetensors")):
        return None
    config = json.loads(cfg_file.read_text())
    if format.is_headlab(config):
        stored = _stored(path)
        with meta_parameters():
            model, state = format.build(config, stored, path)
        names = {id(t): k for k, t in stored.items()}
        if any(id(t) not in names for t in state.values()):
            return None  # the family's upgrade computed tensors: read the model whole
        return model, {**{k: k for k in model.state_dict()},
                       **{k: names[id(t)] for k, t in state.items()}}
    family = registry.by_hf_type(config.get("model_type", "?"))
    if family.weight_map is None:
        return None
    cfg = family.read_config(config)
    wmap = family.weight_map(cfg)
    keys = set(_key_files(path))
    probe = next(iter(wmap.per_layer)).format(0)
    prefix = next((p for p in ("model.", "") if p + probe in keys), None)
    if wmap.splits or wmap.transforms or prefix is None:
        return None
    with meta_parameters():
        model = family.cls(cfg)

    def hf(template: str) -> str:
        return template[1:] if template.startswith("^") else prefix + template

    names = {hl: hf(k) for k, hl in wmap.single.items()}
    for i in range(model.n_layers):
        names.update({hl.format(i): hf(k.format(i)) for k, hl in wmap.per_layer.items()})
    return model, names


def _stored(path: Path) -> dict[str, torch.Tensor]:
    """Each tensor of the checkpoint as a meta tensor of its shape and dtype: nothing is
    read but a zero-row slice (its dtype)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open is no dict)
                piece = h.get_slice(k)
                shape = piece.get_shape()
                dtype = (piece[:0] if shape else h.get_tensor(k)).dtype
                out[k] = torch.empty(shape, dtype=dtype, device="meta")
    return out


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory) and
    their buffers (head ids, gates) real, as accelerate's
    ``init_empty_weights(include_buffers=False)``; unlike it, a parameter registered a
    second time (a tied weight: ``lm_head.weight = wte.weight``) stays the same object.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _key_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})  # noqa: SIM118 (safe_open is no dict)
    return out


@torch.no_grad()
def _read_rows(model: HeadModel, path: Path, names: dict[str, str],
               buffers: dict[str, torch.Tensor], dtype: torch.dtype) -> Reads:
    """Fill each rank's rows of every parameter (FSDP's dim-0 chunks: ceil(n / W) rows
    per rank) and every buffer (whole) from the checkpoint."""
    from safetensors import safe_open

    files = _key_files(path)
    W, r = distributed.world_size(), distributed.rank()
    tensors = elements = 0
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def open_slice(key: str):
            if key not in files:
                raise UserError(f"{path}: the checkpoint has no tensor {key}")
            f = files[key]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return handles[f].get_slice(key)

        for name, p in model.named_parameters():
            piece = open_slice(names[name])
            shape = tuple(piece.get_shape())
            if shape != tuple(p.shape):
                raise UserError(f"{path}: {names[name]} is {shape} in the checkpoint, the "
                                f"model needs {tuple(p.shape)}")
            local = p.to_local()
            chunk = -(-shape[0] // W)
            start = min(r * chunk, shape[0])
            if local.shape[0] != min(shape[0], start + chunk) - start:
                raise RuntimeError(f"{name}: FSDP gave rank {r} {local.shape[0]} rows, "
                                   f"expected the chunk from row {start}")
            if local.numel():
                rows = piece[start:start + local.shape[0]]
                if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
                    raise UserError(f"{path}: {names[name]} holds NaN or inf values; the "
                                    "checkpoint is corrupt")
                local.copy_(rows.to(dtype))
            tensors += 1
            elements += local.numel()
        stored = {k for k in names if k in buffers and names[k] in files}
        for name, b in model.named_buffers():
            b.copy_(open_slice(names[name])[:] if name in stored else buffers[name])
    for attn in model.attentions:
        attn.refresh_layout()
    return Reads(tensors, elements, sliced=True)


def save_sharded(model: HeadModel, directory: str | Path,
                 plan: PrunePlan | None = None) -> Path:
    """Write the sharded ``model``, less ``plan.pruned`` if given, as a headlab
    directory (`headlab.models.format`): one safetensors file per block and one for the
    rest, with their index.

    Every rank gathers one block at a time (collectives); rank 0 alone holds the whole
    block, prunes it as `headlab.prune` would and writes it, so no rank ever holds more
    than one whole block beyond its shards.
    """
    main = distributed.is_main()
    directory = Path(directory)
    cls = next(c for c in type(model).__mro__
               if issubclass(c, HeadModel) and not _fsdp_class(c))
    with meta_parameters():
        skeleton = cls(model.config, layout=model.layout(), **model.extra_config())
    n = model.n_layers
    files: dict[str, str] = {}
    layers = []
    if main:
        directory.mkdir(parents=True, exist_ok=True)
    for i, block in enumerate(model.blocks):
        state = {k: _whole(v) for k, v in block.state_dict().items()}
        if not main:
            continue
        plain = skeleton.blocks[i]
        if state.get("attn.o_proj.bias") is not None and plain.attn.o_proj.bias is None:
            plain.attn.ensure_out_bias()
        plain.to_empty(device="cpu")
        plain.load_state_dict(state)
        plain.attn.refresh_layout()
        plain.attn.streaming = block.attn.streaming
        if plan is not None:
            plain.attn.prune_heads(plan.pruned.get(i, []))
            plain.attn.set_gates(torch.ones(plain.attn.n_heads))
        layers.append(format.layer_meta(plain.attn))
        name = f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors"
        tensors = {f"blocks.{i}.{k}": v for k, v in plain.state_dict().items()}
        format.write_tensors(directory / name, tensors)
        files.update(dict.fromkeys(tensors, name))
        skeleton.blocks[i] = plain.to("meta")
    rest = {k: _whole(v) for k, v in model.state_dict().items() if not k.startswith("blocks.")}
    if main:
        name = f"model-{n + 1:05d}-of-{n + 1:05d}.safetensors"
        format.write_tensors(directory / name, rest)
        files.update(dict.fromkeys(rest, name))
        format.write_meta(model, directory, layers, files=files)
    distributed.barrier()
    return directory


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (an all-gather every rank joins), on CPU."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
