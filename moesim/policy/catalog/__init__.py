"""Systems of the seed papers and their baselines; each module registers its components and systems.

Importing this package registers them all (``moesim.policy.systems`` does so).
"""

from moesim.policy.catalog import buddymoe  # noqa: F401
from moesim.policy.catalog import dali  # noqa: F401
from moesim.policy.catalog import fiddler  # noqa: F401
from moesim.policy.catalog import hybrimoe  # noqa: F401
from moesim.policy.catalog import importance  # noqa: F401
from moesim.policy.catalog import ktransformers  # noqa: F401
from moesim.policy.catalog import llamacpp  # noqa: F401
from moesim.policy.catalog import mixtral_offloading  # noqa: F401
from moesim.policy.catalog import moe_infinity  # noqa: F401
from moesim.policy.catalog import smoe  # noqa: F401
