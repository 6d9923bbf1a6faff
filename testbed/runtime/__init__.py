"""Where hosts live (see base.py). Importing the package registers the built-in runtimes, so that
`base.get_runtime` and `base.all_runtimes` know them whichever module of the package was imported first."""

from testbed.runtime import netns  # noqa: F401 (registers itself; first: the default runtime)
from testbed.runtime import docker  # noqa: F401 (registers itself)
