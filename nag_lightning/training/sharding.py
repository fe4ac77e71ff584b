"""FSDP2 for the Transformer: `torch.distributed.fsdp.fully_shard` on every block, then on the whole
model, over the data-parallel dimension of Lightning's device mesh.

Lightning's `ModelParallelStrategy` builds the mesh and calls the LightningModule's
`configure_model`, which calls `fully_shard_transformer`; every other strategy leaves the model
alone. Each `Block` (one attention and one MLP sublayer with their routers) is one unit: its
parameters are gathered for its forward and backward and freed after. The embedding, the head and
the residual strategy (whose per-sublayer gains every block reads) form the root unit. Parameters
stay fp32, sharded as DTensors; `precision: bf16-mixed` runs the matrix products under autocast,
as on one device, so the NAG state lanes stay fp32 as well.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from nag_lightning.model import Transformer


def fully_shard_transformer(model: Transformer, mesh: DeviceMesh) -> None:
    """Shard `model` in place with FSDP2 over `mesh`'s data-parallel dimension (once: Lightning
    calls `configure_model` again for each later fit, validate or test)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        return

    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"ModelParallelStrategy gave tensor_parallel_size={mesh['tensor_parallel'].size()}, but "
            "this model is sharded with FSDP2 only; set the strategy's data_parallel_size to the "
            "number of devices x nodes and tensor_parallel_size: 1."
        )
    data_parallel = mesh["data_parallel"] if "data_parallel" in names else mesh
    for block in model.blocks:
        fully_shard(block, mesh=data_parallel)
    fully_shard(model, mesh=data_parallel)
