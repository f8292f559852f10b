"""dpscale: differentially private image classification at scale.

The subpackages follow the design card: ``privacy`` makes the guarantee,
``models`` holds the Flax networks, ``stages`` the stateless units of work,
``pipelines`` the Beam graphs and ``cache`` the Zarr feature store.
"""

__version__ = "0.1.0"
