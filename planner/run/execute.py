"""Run a layout for real: one process per rank (gloo on CPU; NCCL on CUDA, one GPU per rank,
``planner.run.device``), PyTorch's own machinery.

- Pipeline stages and schedules: ``torch.distributed.pipelining`` (``PipelineStage`` per
  chunk; 1F1B, GPipe, interleaved 1F1B, interleaved zero bubble for ``zb-h1``, DualPipeV).
  With ``pp = 1`` the micro-batches run one after another on the single stage.
- Recompute: ``torch.utils.checkpoint`` per block, as each block's placement says.
- Expert parallelism: each rank of an ``ep`` group keeps ``E/ep`` experts; tokens travel by
  all-to-all (``torch.distributed._functional_collectives.all_to_all_single_autograd``).
- ZeRO: 0, gradients accumulated in one flat buffer per data-parallel group (Megatron-LM's
  contiguous gradient buffer), all-reduced once per step, and AdamW everywhere; 1, the same
  buffer and ``ZeroRedundancyOptimizer`` (each rank keeps the AdamW state of its share of
  the parameters); 2, the same optimizer, and each micro-batch's gradients of a block go,
  one flat bucket per owning rank, straight to the rank that owns them, which alone
  accumulates them (the others drop them); 3, FSDP2 ``fully_shard`` on every block.
  Dense parameters are shared over the ``dp`` ranks of a pipeline position, routed experts
  over the ``dp/ep`` ranks holding the same experts.

Rank order: data parallel innermost, then pipeline (rank = pp_rank * dp + dp_rank).

Measured per rank, from the runtime (``planner.run.track``): the peak of live tensor bytes
during one step after the others, split into buckets; on CUDA also the caching allocator's
allocated and reserved peaks in that step; the time of each step between two barriers
(the median after warm-up is the step time); the loss of every step.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field
from torch import nn

from planner.errors import PlannerError
from planner.layout import Layout
from planner.run.device import Device
from planner.run.model import DenseLayer, Embedding, Head, MoE, loss_fn
from planner.run.processes import run_ranks
from planner.run.track import Tracker
from planner.schedules import SCHEDULES as REGISTRY
from planner.specs import ModelSpec, TrainingJob

# Schedules the real runs cover: those torch.distributed.pipelining has a class for.
SCHEDULES = {name: s.torch_class for name, s in REGISTRY.items() if s.torch_class}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class RankRun(BaseModel):
    """What one rank measured."""

    rank: int = Field(description="Global rank (pp_rank * dp + dp_rank).")
    pp_rank: int = Field(description="Pipeline position.")
    dp_rank: int = Field(description="Index among the data-parallel ranks of the position.")
    peak_bytes: int = Field(description="Peak of live tensor bytes in the measured step.")
    buckets: dict[str, int] = Field(description="Bytes per bucket at that peak.")
    bucket_peaks: dict[str, int] = Field(
        description="Each bucket's own highest level in the step (bytes)."
    )
    allocated_peak_bytes: int = Field(
        default=0,
        description="Allocated peak in the measured step (bytes): the CUDA caching "
        "allocator's max_memory_allocated; on CPU the live tensor bytes' peak (peak_bytes).",
    )
    reserved_peak_bytes: int | None = Field(
        default=None,
        description="The CUDA caching allocator's reserved peak in the measured step (bytes); "
        "None (not measured) on CPU.",
    )
    step_s: list[float] = Field(description="Wall time of each timed step (s).")
    warmup_s: list[float] = Field(
        default_factory=list, description="Wall time of each warm-up step before them (s)."
    )
    losses: list[float] = Field(description="Mean loss of every step (last stage; else empty).")

    @property
    def median_step_s(self) -> float:
        """Median wall time of the timed steps (s)."""
        return statistics.median(self.step_s)


def check_runnable(model: ModelSpec, job: TrainingJob, layout: Layout) -> int:
    """Refuse what the real runs do not cover, in one line each; return micro-batches per
    step per pipeline."""
    if layout.tp != 1:
        raise PlannerError(f"Layout.tp={layout.tp}: real runs cover tp=1 only")
    if layout.cp > 1:
        raise PlannerError(f"Layout.cp={layout.cp}: real runs cover cp=1 only")
    if layout.schedule not in SCHEDULES:
        raise PlannerError(
            f"Layout.schedule={layout.schedule!r}: real runs cover {', '.join(SCHEDULES)}"
        )
    for dtype in ("weight_dtype", "grad_dtype", "moment_dtype", "activation_dtype"):
        if getattr(job, dtype) != job.weight_dtype or job.weight_dtype not in DTYPES:
            raise PlannerError(
                f"TrainingJob.{dtype}={getattr(job, dtype)!r}: real runs keep weights, "
                "gradients, moments and activations in one dtype, fp32 or bf16"
            )
    if job.master_dtype is not None or job.optimizer != "adamw" or job.ema:
        raise PlannerError("TrainingJob: real runs are plain AdamW (master_dtype=None, no EMA)")
    if model.num_mtp_layers:
        raise PlannerError(f"model {model.name}: real runs do not cover MTP modules")
    if model.tie_word_embeddings:
        ends = {0, len(layout.stages) - 1}
        ranks = {r for r in range(layout.pp) if ends & set(layout.chunks_of_rank(r))}
        if len(ranks) > 1 or layout.zero == 3:
            raise PlannerError(
                f"model {model.name}: a tied embedding and head must sit on one rank, "
                "without ZeRO-3, in real runs"
            )
    if model.num_experts and layout.ep > 1 and layout.zero >= 2 and layout.dp > layout.ep:
        raise PlannerError(
            f"Layout.zero={layout.zero}: real runs shard experts' gradients only when "
            "ep = dp (every expert on one rank of its position)"
        )
    per_step = layout.micro_batch * layout.dp
    if layout.num_microbatches is None and job.global_batch % per_step:
        raise PlannerError(
            f"TrainingJob.global_batch={job.global_batch}: must be a multiple of "
            f"micro_batch*dp={per_step}"
        )
    return layout.num_microbatches or job.global_batch // per_step


def run_layout(
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    *,
    steps: int = 3,
    warmup: int = 1,
    device: Device | None = None,
) -> list[RankRun]:
    """Train ``warmup + steps`` timed steps and one measured step of ``layout`` on
    ``device`` (default the CPU); one entry per rank, in rank order."""
    check_runnable(model, job, layout)
    world = layout.world_size
    device = device or Device()
    device.check_workers(world, "Layout.world_size")
    with tempfile.TemporaryDirectory() as folder:
        run_ranks(
            _worker, lambda port: (model, job, layout, steps, warmup, port, folder, device), world
        )
        return [
            RankRun.model_validate(torch.load(os.path.join(folder, f"{r}.pt")))
            for r in range(world)
        ]


def _worker(
    rank: int,
    model: ModelSpec,
    job: TrainingJob,
    layout: Layout,
    steps: int,
    warmup: int,
    port: int,
    folder: str,
    device: Device,
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = device.bind(rank)  # one node: the local rank is the rank
    dist.init_process_group(
        dev.backend,
        rank=rank,
        world_size=layout.world_size,
        device_id=dev.torch_device if dev.is_cuda else None,  # NCCL: bind the GPU now
    )
    try:
        run = _Rank(rank, model, job, layout, dev)
        times: list[float] = []
        warm: list[float] = []
        losses = []
        timer = dev.timer()
        for i in range(warmup + steps):
            dist.barrier()
            timer.start()
            losses.append(run.step())
            dist.barrier()
            seconds = timer.stop()
            (times if i >= warmup else warm).append(seconds)
        peak, buckets, bucket_peaks, allocated, reserved = run.measured_step()
        out = RankRun(
            rank=rank,
            pp_rank=run.pp_rank,
            dp_rank=run.dp_rank,
            peak_bytes=peak,
            buckets=buckets,
            bucket_peaks=bucket_peaks,
            allocated_peak_bytes=allocated,
            reserved_peak_bytes=reserved,
            step_s=times,
            warmup_s=warm,
            losses=[x for x in losses if x == x],
        )
        torch.save(out.model_dump(), os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


class _Chunk(nn.Module):
    """One stage's blocks in order, each with its recompute choice."""

    def __init__(self, blocks: list[tuple[nn.Module, str]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(b for b, _ in blocks)
        self.choices = [c for _, c in blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, choice in zip(self.blocks, self.choices, strict=True):
            x = block(x, choice)
        return x


class _Rank:
    """One rank's share of the layout, its optimizer and its step."""

    def __init__(
        self, rank: int, model: ModelSpec, job: TrainingJob, layout: Layout, dev: Device
    ) -> None:
        self.rank, self.layout, self.job, self.dev = rank, layout, job, dev
        self.m = check_runnable(model, job, layout)
        dp, pp, ep = layout.dp, layout.pp, layout.ep
        self.pp_rank, self.dp_rank = divmod(rank, dp)
        groups = _Groups(rank, pp, dp, ep)
        self.groups = groups
        dtype = DTYPES[job.weight_dtype]
        self.tracker: Tracker | None = None

        from planner.costs.blocks import block_names

        names = block_names(model)
        built: dict[str, nn.Module] = {}
        self.chunks: list[tuple[int, _Chunk]] = []
        for c in dict.fromkeys(layout.chunks_of_rank(self.pp_rank)):
            blocks = []
            for placed in layout.stages[c].blocks:
                torch.manual_seed(1000 + names.index(placed.block))  # same weights any layout
                with torch.device(dev.torch_device):  # parameters made on the device
                    block = self._block(model, placed.block, dtype, built)
                built[placed.block] = block
                blocks.append((block, placed.recompute))
            self.chunks.append((c, _Chunk(blocks)))
        self.params = list(dict.fromkeys(p for _, chunk in self.chunks for p in chunk.parameters()))
        self.expert = {
            p
            for _, chunk in self.chunks
            for mod in chunk.modules()
            if isinstance(mod, MoE)
            for p in mod.experts.parameters()
        }
        if layout.zero == 3:
            self._fully_shard()
            self.params = list(
                dict.fromkeys(p for _, chunk in self.chunks for p in chunk.parameters())
            )
        self.optimizers = self._optimizers()
        self.acc: dict[nn.Parameter, torch.Tensor] = {}
        self.buckets: list[tuple[torch.Tensor, Any, list[nn.Parameter]]] = []
        if layout.zero < 2:
            self._grad_buckets()
        if layout.zero < 2:  # ZeRO-2's fresh gradients are its reduce bucket: not claimed
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._claim_grad)
        if layout.zero == 2:
            self._bucket_by_block()
        self._data(model)
        self.stages: list[Any] = []
        self.schedule = self._schedule(model) if pp > 1 else None

    # -- building -----------------------------------------------------------------------
    def _block(
        self, model: ModelSpec, name: str, dtype: torch.dtype, built: dict[str, nn.Module]
    ) -> nn.Module:
        if name == "embedding":
            return Embedding(model, dtype)
        if name == "head":
            tied = built["embedding"].weight if model.tie_word_embeddings else None
            assert tied is None or isinstance(tied, nn.Parameter)
            return Head(model, dtype, tied)
        if not name.startswith("layer."):
            raise PlannerError(f"block {name!r}: real runs cover embedding, layers and head")
        index = int(name.split(".")[1])
        layer = DenseLayer(model, dtype, moe=model.is_moe_layer(index))
        if isinstance(layer.ffn, MoE) and self.layout.ep > 1:
            layer.ffn.shard_experts(self.groups.ep, self.layout.ep, self.groups.ep_rank)
        if isinstance(layer.ffn, MoE) and self.job.moe_force_balance:
            layer.ffn.force_balance()
        return layer

    def _fully_shard(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        if self.layout.ep > 1:
            raise PlannerError("Layout.zero=3: real runs cover ZeRO-3 with ep=1 only")
        mesh = (
            None
            if self.layout.pp == 1
            else DeviceMesh.from_group(self.groups.dp, self.dev.torch_device.type)
        )
        for _, chunk in self.chunks:
            for block in chunk.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(chunk, mesh=mesh)

    def _optimizers(self) -> list[Any]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dense = [p for p in self.params if p not in self.expert]
        experts = [p for p in self.params if p in self.expert]
        out: list[Any] = []
        self.owner: dict[nn.Parameter, int] = {}
        for params, group in ((dense, self.groups.dp), (experts, self.groups.edp)):
            if not params:
                continue
            size = dist.get_world_size(group)
            if self.layout.zero in (1, 2) and size > 1:
                opt = ZeroRedundancyOptimizer(
                    params,
                    optimizer_class=torch.optim.AdamW,
                    process_group=group,
                    lr=1e-3,
                    foreach=False,
                    parameters_as_bucket_view=True,  # one broadcast per rank's share
                )
                for p, local in opt._param_to_rank.items():  # type: ignore[attr-defined]
                    self.owner[p] = dist.get_global_rank(group, local)
                out.append(opt)
            else:
                out.append(torch.optim.AdamW(params, lr=1e-3, foreach=False))
                self.owner.update(dict.fromkeys(params, self.rank))
        return out

    def _data(self, model: ModelSpec) -> None:
        """The global batch, the same for every layout; this rank's share of it."""
        gen = torch.Generator().manual_seed(0)
        total = self.m * self.layout.micro_batch * self.layout.dp
        tokens = torch.randint(model.vocab_size, (total, self.job.seq_len + 1), generator=gen)
        share = self.m * self.layout.micro_batch
        mine = tokens[self.dp_rank * share : (self.dp_rank + 1) * share]
        mine = mine.to(self.dev.torch_device)
        self.x, self.y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def _schedule(self, model: ModelSpec) -> Any:
        import torch.distributed.pipelining as pipelining

        stages = [
            pipelining.PipelineStage(
                chunk, c, len(self.layout.stages), self.dev.torch_device, group=self.groups.pp
            )
            for c, chunk in self.chunks
        ]
        self.stages = stages
        entry = REGISTRY[self.layout.schedule]
        cls = getattr(pipelining, str(entry.torch_class))
        single = not entry.torch_holds_sends
        return cls(stages[0] if single else stages, self.m, loss_fn=loss_fn)

    # -- the step -----------------------------------------------------------------------
    @property
    def first(self) -> bool:
        return any(c == 0 for c, _ in self.chunks)

    @property
    def last(self) -> bool:
        return any(c == len(self.layout.stages) - 1 for c, _ in self.chunks)

    def step(self) -> float:
        """One optimizer step over this rank's micro-batches; the mean loss on the rank that
        computes it (NaN elsewhere)."""
        loss = float("nan")
        if self.schedule is None:
            total = 0.0
            mb = self.layout.micro_batch
            for i in range(self.m):
                out = self.x[i * mb : (i + 1) * mb]
                for _, chunk in self.chunks:
                    out = chunk(out)
                part = loss_fn(out, self.y[i * mb : (i + 1) * mb]) / self.m
                del out
                part.backward()
                total += float(part.detach())
            loss = total
        else:
            losses: list[torch.Tensor] = []
            args = (self.x,) if self.first else ()
            target = self.y if self.last else None
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            if losses:
                loss = float(torch.stack([t.detach() for t in losses]).mean())
        self._sync_grads()
        for opt in self.optimizers:
            opt.step()
        if self.tracker is not None:
            self._claim_state()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.acc.clear()
        self._point_grads()
        return loss

    def _group_of(self, p: nn.Parameter) -> Any:
        return self.groups.edp if p in self.expert else self.groups.dp

    def _sync_grads(self) -> None:
        if self.layout.zero == 3:
            return  # FSDP2 reduce-scattered every micro-batch
        if self.layout.zero == 2:
            for p, acc in self.acc.items():
                p.grad = acc.div_(dist.get_world_size(self._group_of(p)))
            return
        for bucket, group, _ in self.buckets:  # one all-reduce per group, as DDP buckets
            dist.all_reduce(bucket, group=group)
            bucket.div_(dist.get_world_size(group))

    def _grad_buckets(self) -> None:
        """ZeRO-0/1 gradients live in one flat buffer per data-parallel group (Megatron-LM's
        contiguous gradient buffer), so each group reduces them in one all-reduce; each
        parameter's ``.grad`` is its view, accumulated in place micro-batch after
        micro-batch. Same bytes as separate gradients."""
        dense = [p for p in self.params if p not in self.expert]
        experts = [p for p in self.params if p in self.expert]
        for params, group in ((dense, self.groups.dp), (experts, self.groups.edp)):
            if params and dist.get_world_size(group) > 1:
                total = sum(p.numel() for p in params)
                self.buckets.append((params[0].new_zeros(total), group, params))
        self._point_grads()

    def _point_grads(self) -> None:
        for bucket, _, params in self.buckets:
            bucket.zero_()
            offset = 0
            for p in params:
                p.grad = bucket[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    def _bucket_by_block(self) -> None:
        """ZeRO-2 reduces gradients block by block (a block is a bucket): once every
        parameter of a block has its gradient for the micro-batch, they go to their owners.
        Blocks finish in the same order on every rank, so the reductions match."""
        seen: set[nn.Parameter] = set()
        for _, chunk in self.chunks:
            for block in chunk.blocks:
                params = [p for p in block.parameters() if p not in seen]
                seen.update(params)
                ready: list[int] = [0]

                def hook(
                    _: nn.Parameter, params: list[nn.Parameter] = params, ready: list[int] = ready
                ) -> None:
                    ready[0] += 1
                    if ready[0] == len(params):
                        ready[0] = 0
                        self._reduce_to_owners(params)

                for p in params:
                    p.register_post_accumulate_grad_hook(hook)

    def _reduce_to_owners(self, params: list[nn.Parameter]) -> None:
        """ZeRO-2: the block's gradients go, one flat bucket per owning rank, to the rank
        owning their parameters, which alone accumulates them; the others drop them. In
        parameter order, so every rank of a group issues the same reductions."""
        segments: dict[tuple[int, int], list[nn.Parameter]] = {}
        for p in params:
            segments.setdefault((id(self._group_of(p)), self.owner[p]), []).append(p)
        for (_, owner), members in segments.items():
            group = self._group_of(members[0])
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in members]
            for p in members:
                p.grad = None
            flat = torch.cat([g.reshape(-1) for g in grads])
            del grads
            if dist.get_world_size(group) > 1:
                dist.reduce(flat, dst=owner, group=group)
            if owner != self.rank:
                continue
            offset = 0
            for p in members:
                view = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p in self.acc:
                    self.acc[p].add_(view)
                else:
                    self.acc[p] = view
                    self._claim("grads", view)

    def _claim_grad(self, p: nn.Parameter) -> None:
        self._claim("grads", p.grad)

    def _claim(self, bucket: str, *tensors: Any) -> None:
        if self.tracker is not None:
            self.tracker.claim(bucket, *tensors)

    def _claim_state(self) -> None:
        assert self.tracker is not None
        # The pipeline's receive buffers (activations in, gradients back), one per chunk
        # and micro-batch, made in the first step and kept for the next ones.
        for stage in self.stages:
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                for info in infos:
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor) and not getattr(info, "is_root_arg", 0):
                        self.tracker.claim("other", buffer)
        for p in self.params:
            self.tracker.claim("weights", p)
            if p.grad is not None:
                self.tracker.claim("grads", p.grad)
        for opt in self.optimizers:
            inner = getattr(opt, "optim", opt)
            for state in inner.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        self.tracker.claim("optimizer", value)

    def measured_step(self) -> tuple[int, dict[str, int], dict[str, int], int, int | None]:
        """One more step, followed tensor by tensor: its peak, the buckets at the peak,
        each bucket's own peak, and the allocated and reserved peaks (``Device.memory``)."""
        tracker = Tracker()
        self.tracker = tracker
        self._claim_state()
        params = {
            (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
            for p in self.params
        }
        with tracker, tracker.saving(params), self.dev.memory(tracker) as watch:
            tracker.reset_peak()
            self.step()
        self.tracker = None
        return (
            tracker.peak,
            tracker.peak_buckets(),
            dict(tracker.bucket_peaks),
            watch.peak_allocated(),
            watch.peak_reserved(),
        )


class _Groups:
    """Process groups of a (pp, dp) grid with ep-sized expert groups inside each dp group.
    Every rank creates every group, in the same order (``new_group`` is collective)."""

    def __init__(self, rank: int, pp: int, dp: int, ep: int) -> None:
        self.ep_rank = rank % dp % ep
        mine: dict[str, Any] = {}

        def make(kind: str, ranks: list[int]) -> None:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group

        for j in range(dp):
            make("pp", [q * dp + j for q in range(pp)])
        for q in range(pp):
            make("dp", [q * dp + j for j in range(dp)])
            for start in range(0, dp, ep):
                make("ep", [q * dp + j for j in range(start, start + ep)])
            for offset in range(ep):
                make("edp", [q * dp + j for j in range(offset, dp, ep)])
        self.pp: Any = mine["pp"]
        self.dp: Any = mine["dp"]
        self.ep: Any = mine["ep"]
        self.edp: Any = mine["edp"]
