"""Device meshes and logical-axis sharding rules (batch -> data, heads -> model).

This module sits below kvjax.models and the caches and imports none of them: the params' logical axes
and `param_shardings` are in `kvjax.models.loading`, next to the param shapes; each cache layout
names its own arrays' logical axes (`shardings(mesh)`).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

# logical axis -> mesh axis
RULES = {"batch": "data", "kv_heads": "model", "heads": "model", "mlp": "model", "vocab": "model"}

def make_mesh(data: int | None = None, model: int = 1, devices: list | None = None) -> Mesh:
    """A ("data", "model") mesh; `data` defaults to all devices not used by `model`."""
    devices = devices or jax.devices()
    if model < 1 or len(devices) % model:
        raise ValueError(f"model={model} must be >= 1 and divide the {len(devices)} devices")
    data = data or len(devices) // model
    if data * model > len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices; {len(devices)} available")
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: data * model])


def logical_sharding(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, units: dict[str, int] | None = None) -> NamedSharding:
    """Maps logical axes to mesh axes, leaving a dimension replicated when the mesh axis does not divide it.

    units: logical axis -> number of indivisible units in it (e.g. heads), which must divide evenly.
    """
    spec = []
    for name, size in zip(axes, shape):
        mesh_axis = RULES.get(name)
        n = (units or {}).get(name, size)
        if mesh_axis is None or n % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
    return NamedSharding(mesh, P(*spec))
