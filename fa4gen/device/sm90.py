"""Device helpers specific to Hopper kernels: TMA partitioning and mbarrier pipeline creation.

Kept out of the templates so that every generated SM90 kernel wires the same, tested pieces.
"""

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync


def tma_split(atom: cute.CopyAtom, s: cute.Tensor, g: cute.Tensor):
    """(smem view, gmem view) of a TMA copy between a staged smem buffer and a tiled gmem tensor."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))


def tma_pipeline(mbar, stages: int, nbytes: int, consumer_warps: int) -> pipeline.PipelineTmaAsync:
    """A TMA-fed pipeline: one producer thread arms each stage for `nbytes`; every consumer warp
    releases it once. Barrier init is deferred: the caller fences and syncs once for all pipelines."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=nbytes,
        defer_sync=True,
    )
