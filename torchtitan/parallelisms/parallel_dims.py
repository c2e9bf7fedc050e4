"""Parallel degrees and the device mesh they describe.

The world is split as ``dp_replicate x dp_shard x tp`` (outermost to innermost, so tensor-parallel ranks are
neighbours and share the fastest links). ``dp_shard = -1`` takes whatever the other two leave.

With one process and no parallelism, :meth:`ParallelDims.build_mesh` returns ``None`` (no process group is needed
to train on one device) and :func:`parallelize_llama` then only applies activation checkpointing, float8 and compile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserError

# Mesh dimension names, outermost first; "dp" is the flattened (replicate, shard) dimension.
MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")
DP_MESH_NAME = "dp"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    enable_loss_parallel: bool = True
    # The mesh build_mesh made and its flattened "dp" mesh: torch wants the latter kept, not sliced again.
    _world_mesh: Optional[DeviceMesh] = field(default=None, init=False, repr=False, compare=False)
    _dp_mesh: Optional[DeviceMesh] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_job_config(cls, job_config: JobConfig, world_size: int) -> ParallelDims:
        """The degrees and the loss-parallel choice of ``job_config``'s ``[training]`` over ``world_size`` ranks."""
        t = job_config.training
        replicate, shard = t.data_parallel_replicate_degree, t.data_parallel_shard_degree
        if t.data_parallel_type == "ddp":
            # Whole-model replicas: FSDP2 over a (replicate, shard = 1) mesh all-reduces gradients, as DDP does.
            replicate = shard if shard != -1 else max(1, world_size // t.tensor_parallel_degree)
            shard = 1
        return cls(
            dp_replicate=replicate,
            dp_shard=shard,
            tp=t.tensor_parallel_degree,
            world_size=world_size,
            enable_loss_parallel=not t.disable_loss_parallel,
        )

    def validate(self) -> None:
        """Fill ``dp_shard = -1`` and check that the degrees multiply to the world size."""
        for name in ("dp_replicate", "tp", "world_size"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel degree {name} must be at least 1; got {getattr(self, name)}")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.tp
            if self.world_size % others:
                raise UserError(
                    f"world size {self.world_size} is not divisible by data_parallel_replicate_degree x "
                    f"tensor_parallel_degree = {self.dp_replicate} x {self.tp}; change the degrees or the process count"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise UserError(f"training.data_parallel_shard_degree must be -1 (fill) or positive; got {self.dp_shard}")
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise UserError(
                f"parallel degrees dp_replicate x dp_shard x tp = {self.dp_replicate} x {self.dp_shard} x {self.tp} "
                f"= {product} do not match the world size {self.world_size}; make their product equal the process count"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate_enabled or self.dp_shard_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.enable_loss_parallel

    @property
    def any_parallelism(self) -> bool:
        return self.dp_enabled or self.tp_enabled

    def build_mesh(self, device_type: str) -> Optional[DeviceMesh]:
        """One mesh over the enabled dimensions (degree > 1), plus the flattened "dp" dimension.

        Returns ``None`` for a single process without parallelism. Dimensions of degree 1 are left out so that no
        size-1 process groups are created, except "dp_shard" beside an enabled "dp_replicate": FSDP2 replicates
        only over a 2-D (replicate, shard) mesh.
        """
        if not self.any_parallelism:
            return None
        names = [name for name in MESH_DIM_NAMES if self.degrees[name] > 1 or self._hsdp_needs(name)]
        mesh = init_device_mesh(device_type, tuple(self.degrees[n] for n in names), mesh_dim_names=tuple(names))
        dp_names = tuple(n for n in names if n.startswith("dp_"))
        if dp_names:
            self._dp_mesh = mesh[dp_names]._flatten(mesh_dim_name=DP_MESH_NAME)
        self._world_mesh = mesh
        return mesh

    def _hsdp_needs(self, name: str) -> bool:
        return name == "dp_shard" and self.dp_replicate_enabled

    def dp_rank_and_degree(self, mesh: Optional[DeviceMesh]) -> tuple[int, int]:
        """This rank's index among the data-parallel ranks and their count; (0, 1) without data parallelism."""
        dp = self.dp_mesh(mesh)
        if dp is None:
            return 0, 1
        return dp.get_local_rank(), dp.size()

    def dp_mesh(self, mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
        """The flattened 1-D data-parallel mesh (for data loading and loss averaging); None without DP."""
        if mesh is None or not self.dp_enabled:
            return None
        if mesh is self._world_mesh and self._dp_mesh is not None:
            return self._dp_mesh
        return mesh[DP_MESH_NAME]

    def fsdp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        """The mesh FSDP2 shards over: 2-D (replicate, shard) for HSDP, 1-D otherwise; None without DP."""
        if self.dp_replicate_enabled:
            # A dp_shard degree of 1 here is plain replication (DDP-like) through the same FSDP2 code path.
            return mesh["dp_replicate", "dp_shard"]
        if self.dp_shard_enabled:
            return mesh["dp_shard"]
        return None
