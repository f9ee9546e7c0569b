"""`tempering.autorl`: train on a task described in plain language (the code is in integrations/autorl.py)."""

from .integrations.autorl import *  # the public names are the implementation's __all__
from .integrations.autorl import __all__  # noqa: F401
