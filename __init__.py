"""dpscale: differentially private image classification at scale.

The repository root is this package: the subpackages at the root install under the one
import name ``dpscale`` (``dpscale.models``, ``dpscale.data``, ...), so nothing with a generic
name lands in site-packages. Lowest layer first, each importing only from the layers below
it (``tests/test_architecture.py`` keeps it so): the modules ``errors``, ``files``,
``progress`` and ``distributed``; ``models`` the Flax networks; ``privacy`` the guarantee
and ``data`` the ingested datasets; ``cache`` the Zarr feature store and ``dedup`` the
near-duplicates between public and private images; ``training`` the DP training run;
``audit`` the empirical privacy audits and ``pipelines`` the Beam graphs; ``stages`` the
commands, one module each; ``cli`` the command line over them.
"""

__version__ = "0.1.0"
