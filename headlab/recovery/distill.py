"""A short knowledge distillation of a pruned model toward the unpruned one.

The pruned model (the student) learns to reproduce the reference (the teacher, the
model before pruning) on the scoring blocks, by the loss of its kind of model:

    causal-lm   KL(teacher || student) of the next-token distributions at temperature
                T, times T^2, over the positions the objective scores (real token pairs)
    masked-lm   the same at the masked positions
    classifier  that KL over the classes, plus the cross-entropy to the labels
    embedding   1 - cos between the student's and the teacher's sentence embeddings

The loss is the objective's (`headlab.objectives.Objective.distill_loss`), and so are
the positions a KL runs over: causal and masked LMs both put out (B, S, V) logits, so
the output alone cannot say which positions count.

Only a chosen set of parameters trains (`PARAMS`); head gates are buffers and never
do. AdamW without weight decay (decay would move weights the loss does not touch,
such as those of a masked head), the model in eval mode (no dropout: a resumed run
repeats the uninterrupted one bit for bit), batches in an order fixed by ``seed``.

On a model sharded by FSDP2 (`headlab.parallel.sharding`) every rank runs every step in
lockstep, teacher sharded too: each computes the same loss, FSDP averages the equal
gradients over the ranks, and AdamW, element by element, updates each rank's rows
(DTensors) as one process would update the whole. The checkpoint, one file per rank,
holds that rank's rows and their optimizer state, so a resume needs the same ranks.
LoRA does not run sharded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from headlab._util.checkpoint import Checkpoint
from headlab._util.progress import track
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.objectives import objective_for
from headlab.recovery.sanity import check_sane
from headlab.recovery.sharded import all_sum, is_fsdp, local

PARAMS = ("out", "attention", "all", "lora")
_PROJECTIONS = {"out": ("o_proj",), "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "lora": ("q_proj", "k_proj", "v_proj", "o_proj")}
_LORA_MISSING = "--recover-params lora needs the peft package: pip install peft"
LORA_SHARDED = ("--recover-params lora does not run with --shard fsdp (peft does not adapt "
                "fully_shard units): use --recover-params out, attention or all")
_ADAPTER = "distill"


def distill(
    pruned: HeadModel,
    reference: HeadModel,
    blocks: Blocks,
    *,
    tokens: int | None = None,
    params: str = "out",
    temperature: float = 1.0,
    lr: float = 1e-4,
    batch_size: int = 8,
    accumulate: int = 1,
    seed: int = 0,
    lora_rank: int = 8,
    checkpoint: Checkpoint | None = None,
    checkpoint_key: str = "recover/distill",
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Distil ``reference`` into ``pruned`` in place on ``blocks``; return a summary.

    ``tokens``: the budget of real tokens (None: one pass over the blocks); the last
    batch that reaches it is used whole. ``params``: what trains, one of `PARAMS`:
    ``out`` the attention output projections (weight and bias), ``attention`` every
    attention's q/k/v/o projections, ``all`` every parameter, ``lora`` rank
    ``lora_rank`` adapters (peft) on the attention projections, merged into the
    weights at the end, so the model keeps plain ``nn.Linear`` weights and its
    parameter names. A step averages the loss over ``accumulate`` batches of
    ``batch_size`` blocks.

    With a ``checkpoint``, the trainable tensors, the optimizer state, the step and
    the losses so far are saved every ``checkpoint.every`` steps, when interrupted and
    at the end; a later call with the same options resumes from them. The batch order
    is a function of ``seed`` alone, so the step fixes where it continues.
    ``on_step(step, loss)`` is called after each step (1-based).

    On any error or interrupt the model's weights are put back as they were before
    the call. A non-finite loss or gradient raises UserError naming the step.

    Returns ``{"method", "params", "tokens", "token_budget", "steps", "seconds",
    "loss_first", "loss_last", "losses", "trainable_parameters", ...options}``.
    """
    objective = objective_for(pruned)
    _validate(pruned, reference, blocks, objective, tokens=tokens, params=params,
              temperature=temperature, lr=lr, batch_size=batch_size, accumulate=accumulate,
              lora_rank=lora_rank)
    blocks = objective.prepare(reference, blocks, batch_size=batch_size, seed=seed)
    schedule = _schedule(blocks, tokens=tokens, batch_size=batch_size, accumulate=accumulate,
                         seed=seed)
    step_tokens = [sum(int(blocks.attention_mask[rows].sum()) for rows in step)
                   for step in schedule]
    options = {"params": params, "token_budget": tokens, "temperature": temperature, "lr": lr,
               "batch_size": batch_size, "accumulate": accumulate, "seed": seed,
               **({"lora_rank": lora_rank} if params == "lora" else {})}
    # enough of the blocks to tell a checkpoint of other data
    data = [len(blocks), blocks.n_tokens, int(blocks.input_ids.sum())]

    if is_fsdp(pruned):  # a root left gathered (lsq's `ready`) puts the gathered copies of
        pruned.reshard()  # tied weights in their modules: the sharded ones are what trains
    modes = (pruned.training, reference.training)
    requires = {name: p.requires_grad for name, p in pruned.named_parameters()}
    lora, trainable, before = None, {}, {}
    start, losses, seconds = 0, [], 0.0
    done, updating, t0 = 0, False, time.perf_counter()

    def save() -> None:
        if checkpoint is not None:
            checkpoint.put(checkpoint_key, {
                "step": done, "losses": losses, "options": options, "data": data,
                "seconds": seconds + time.perf_counter() - t0,
                "trainable": {n: local(p).detach() for n, p in trainable.items()},
                "optimizer": _local_state(optimizer),
            })

    label = _LossLabel("distilling", math.nan)
    pruned.eval()
    reference.eval()
    try:
        try:
            lora = _add_lora(pruned, lora_rank, seed) if params == "lora" else None
            trainable = _trainable(pruned, params)
            # what to put back on failure; LoRA leaves the base weights alone until merged
            before = {} if lora else {n: local(p).detach().clone()
                                      for n, p in trainable.items()}
            for p in pruned.parameters():
                p.requires_grad_(False)
            for p in trainable.values():
                p.requires_grad_(True)
            optimizer = torch.optim.AdamW(list(trainable.values()), lr=lr, weight_decay=0.0)
            saved = checkpoint.get(checkpoint_key) if checkpoint is not None else None
            if saved is not None:
                _check_resumable(saved, options, data, trainable, checkpoint)
                start, losses, seconds = saved["step"], list(saved["losses"]), saved["seconds"]
                with torch.no_grad():
                    for name, p in trainable.items():
                        local(p).copy_(saved["trainable"][name])
                _load_state(optimizer, saved["optimizer"])
                label.loss = losses[-1] if losses else math.nan
            done = start
            for step in track(range(start, len(schedule)), total=len(schedule) - start,
                              description=label):
                loss = 0.0
                for rows in schedule[step]:
                    batch = next(blocks.subset(rows).batches(len(rows)))
                    with torch.no_grad():
                        teacher = objective.forward(reference, batch)
                    student = objective.forward(pruned, batch)
                    micro = objective.distill_loss(pruned, student, reference, teacher, batch,
                                                   temperature) / len(schedule[step])
                    if not torch.isfinite(micro):
                        raise UserError(_not_finite("loss", micro.item(), step + 1))
                    micro.backward()
                    loss += micro.item()
                # sharded: each rank holds some rows of each gradient; all must agree
                norms = [local(p.grad).norm() for p in trainable.values()
                         if p.grad is not None]
                if norms and not torch.isfinite(all_sum(pruned, torch.stack(norms).sum())):
                    raise UserError(_not_finite("gradient", math.nan, step + 1))
                updating = True  # an interrupt now would leave half-updated weights
                optimizer.step()
                updating = False
                optimizer.zero_grad(set_to_none=True)
                done = step + 1
                losses.append(loss)
                label.loss = loss
                if checkpoint is not None and done % checkpoint.every == 0:
                    save()
                if on_step is not None:
                    on_step(done, loss)
            check_sane(pruned, reference, "distill")  # a diverged run is put back below
        except BaseException as exc:
            try:
                if isinstance(exc, KeyboardInterrupt) and not updating and done > start:
                    save()
            finally:
                _restore(trainable, lora, before)
            raise
        if done > start:
            save()
        if lora is not None:
            lora.merge_and_unload(safe_merge=True)
    finally:
        if is_fsdp(pruned):
            pruned.reshard()
        for name, p in pruned.named_parameters():
            p.requires_grad_(requires.get(name, False))
        pruned.train(modes[0])
        reference.train(modes[1])
    seconds += time.perf_counter() - t0
    return {"method": "distill", **options, "tokens": sum(step_tokens),
            "steps": len(schedule), "seconds": seconds,
            "loss_first": losses[0] if losses else math.nan,
            "loss_last": losses[-1] if losses else math.nan, "losses": losses,
            "trainable_parameters": sum(p.numel() for p in trainable.values())}


# ---------------------------------------------------------------- what trains
def _trainable(model: nn.Module, params: str) -> dict[str, nn.Parameter]:
    """The named parameters that train (empty tensors of fully pruned layers left out)."""
    if params == "lora":
        chosen = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    elif params == "all":
        chosen = list(model.named_parameters())
    else:
        wanted = {id(p) for attn in model.attentions for proj in _PROJECTIONS[params]
                  for p in getattr(attn, proj).parameters()}
        chosen = [(n, p) for n, p in model.named_parameters() if id(p) in wanted]
    return {n: p for n, p in chosen if p.numel()}


def _add_lora(model: HeadModel, rank: int, seed: int):
    """Wrap the attention projections with peft LoRA adapters (in place); the adapter
    initialisation is seeded and leaves the global RNG as it was."""
    try:
        from peft import LoraConfig
        from peft.tuners.lora import LoraModel
    except ImportError:
        raise UserError(_LORA_MISSING) from None
    names = {id(m): n for n, m in model.named_modules()}
    targets = [names[id(proj)] for attn in model.attentions for proj_name in _PROJECTIONS["lora"]
               if (proj := getattr(attn, proj_name)).weight.numel()]
    if not targets:
        raise UserError("--recover-params lora: the model has no attention projection left "
                        "to adapt")
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=targets,
                        bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LoraModel(model, config, _ADAPTER)


def _restore(trainable: dict[str, nn.Parameter], lora, before: dict[str, torch.Tensor]) -> None:
    """Put the weights back as they were before `distill` (LoRA: drop the adapters)."""
    if lora is not None:
        lora.unload()
        return
    with torch.no_grad():
        for name, value in before.items():
            local(trainable[name]).copy_(value)


def _local_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict, each DTensor state as this rank's rows."""
    state = optimizer.state_dict()
    state["state"] = {i: {k: local(v) for k, v in s.items()}
                      for i, s in state["state"].items()}
    return state


def _load_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load `_local_state`'s dict, each state of a sharded parameter made a DTensor
    with the parameter's rows again."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(state)
    for p, s in optimizer.state.items():
        if isinstance(p, DTensor):
            for k, v in s.items():
                if k != "step" and not isinstance(v, DTensor):
                    s[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                              stride=p.stride(), run_check=False)


# ---------------------------------------------------------------- batches
def _schedule(blocks: Blocks, *, tokens: int | None, batch_size: int, accumulate: int,
              seed: int) -> list[list[torch.Tensor]]:
    """Each step's batches, as row indices: seeded shuffles of the blocks, pass after
    pass, until ``tokens`` real tokens are reached (None: one pass)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = blocks.attention_mask.sum(1)  # (N,)
    budget = blocks.n_tokens if tokens is None else tokens
    batches, used = [], 0
    while used < budget:
        for rows in torch.randperm(len(blocks), generator=gen).split(batch_size):
            batches.append(rows)
            used += int(per_row[rows].sum())
            if used >= budget:
                break
    return [batches[i:i + accumulate] for i in range(0, len(batches), accumulate)]


# ---------------------------------------------------------------- checks
def _validate(pruned, reference, blocks, objective, *, tokens, params, temperature, lr,
              batch_size, accumulate, lora_rank) -> None:
    if params not in PARAMS:
        raise UserError(f"unknown --recover-params {params!r}; choose from {', '.join(PARAMS)}")
    if params == "lora" and is_fsdp(pruned):
        raise UserError(LORA_SHARDED)
    if tokens is not None and tokens <= 0:
        raise UserError(f"--recover-tokens must be a positive number of tokens, got {tokens}")
    for name, value in (("temperature", temperature), ("learning rate", lr)):
        if not value > 0 or not math.isfinite(value):
            raise UserError(f"distillation {name} must be a positive number, got {value}")
    for name, value in (("batch size", batch_size), ("accumulation", accumulate),
                        ("LoRA rank", lora_rank)):
        if value < 1:
            raise UserError(f"distillation {name} must be at least 1, got {value}")
    if pruned is reference:
        raise UserError("distillation needs the unpruned model as the reference, not the "
                        "pruned model itself: pass a copy made before pruning")
    if objective_for(reference) is not objective:
        raise UserError(f"the reference is a {objective_for(reference).kind} model and the "
                        f"pruned model a {objective.kind} one: distil a model toward its own "
                        "unpruned original")
    if len(blocks) == 0 or blocks.n_tokens == 0:
        raise UserError(f"{blocks.spec}: no tokens to distil on")


def _not_finite(what: str, value: float, step: int) -> str:
    return (f"distillation {what} is {value} at step {step}; the model is left as it was: "
            "try a lower --recover-lr, or --dtype float32")


def _check_resumable(saved: dict, options: dict, data: list[int], trainable: dict,
                     checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint that another distillation (options, data, model) wrote."""
    shapes = {n: tuple(local(p).shape) for n, p in trainable.items()}  # sharded: the rows
    saved_shapes = {n: tuple(t.shape) for n, t in saved["trainable"].items()}
    if saved["options"] != options or saved["data"] != data or saved_shapes != shapes:
        changed = sorted(k for k in options if saved["options"].get(k) != options[k])
        what = (f"options {', '.join(changed)}" if changed
                else "data" if saved["data"] != data else "trainable tensors")
        raise UserError(f"checkpoint {checkpoint.path} holds a distillation with other "
                        f"{what}; use the same options or delete it to start over")


class _LossLabel(str):
    """The progress bar's description, showing the running loss: the bar formats its
    description each time it draws (`headlab._util.progress.track` takes it once)."""

    def __new__(cls, text: str, loss: float) -> _LossLabel:
        label = super().__new__(cls, text)
        label.loss = loss
        return label

    def __format__(self, spec: str) -> str:
        return str(self) if math.isnan(self.loss) else f"{str(self)} (loss {self.loss:.4g})"
