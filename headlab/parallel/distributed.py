"""Data parallelism on torch.distributed, as started by ``torchrun``.

Each rank takes a disjoint shard of the blocks (rank r takes batches r, r + W, ..., so no
block is dropped or counted twice when the count does not divide by W; with fewer
batches than ranks the examples are shared out, see `shard_rows`), sums
its accumulators locally in float64, and the sums are all-reduced. Rank 0 alone writes
files and prints. Backend: gloo on CPU, nccl on CUDA, chosen automatically.

    torchrun --nproc_per_node 2 -m headlab score --model minilm-l6
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def init_from_env(device: str = "cpu") -> bool:
    """Join the process group torchrun describes (RANK/WORLD_SIZE set); False if none."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if device.startswith("cuda") and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    return True


_data_parallel = True  # off while the weights are sharded (headlab.parallel.sharding)


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def set_data_parallel(on: bool) -> None:
    """Whether ranks share the data (the default) or every rank sees every batch.

    `headlab.parallel.sharding` turns it off: with FSDP every rank must take part in every
    block's forward and backward, so the ranks compute the same batches in lockstep
    and their sums are already the whole data's (nothing is all-reduced)."""
    global _data_parallel
    _data_parallel = on


def data_parallel() -> bool:
    return active() and _data_parallel


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def data_rank() -> int:
    """This rank's place among the ranks sharing the data (0 when every rank sees all)."""
    return rank() if data_parallel() else 0


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random draws of one step (a batch, a training step) of a seeded run: its own
    per data rank, and the same again when a resumed run repeats that step."""
    return torch.Generator().manual_seed((seed * 1_000_003 + data_rank()) * 1_000_003 + step)


def is_main() -> bool:
    return rank() == 0


def shard_rows(n: int, batch_size: int = 1) -> list[int]:
    """This rank's row indices of n rows (all of them outside torchrun).

    With at least as many batches as ranks, whole batches are dealt out (batch b goes
    to rank b mod W), so each example is computed in the same batch as in a
    single-process run and the results agree to the last bit before the float64 sums;
    a last, short batch is never dropped. With fewer batches than ranks the examples
    themselves are shared: rank r takes rows [r n / W, (r + 1) n / W), batched as
    usual, and a rank left with none contributes zeros to the sums.
    """
    if not data_parallel():
        return list(range(n))
    n_batches = -(-n // batch_size)
    if n_batches < world_size():
        return list(range(rank() * n // world_size(), (rank() + 1) * n // world_size()))
    return [row for b in range(rank(), n_batches, world_size())
            for row in range(b * batch_size, min(n, (b + 1) * batch_size))]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks sharing the data (returned; the input is left as it was on
    one rank, and when every rank saw every batch)."""
    if not data_parallel():
        return t
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    out = t.detach().to(device=device).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def sum_floats(*values: float) -> tuple[float, ...]:
    """All-reduce a few Python numbers in float64 (over ranks sharing the data)."""
    if not data_parallel():
        return values
    t = all_reduce_sum(torch.tensor(values, dtype=torch.float64))
    return tuple(float(v) for v in t)


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (plans decided once, applied everywhere)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()


def available(device: str) -> int:
    """Bytes one rank may use: its GPU's memory, or this machine's RAM shared by the
    ranks torchrun started on it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev.index or 0).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
